#!/usr/bin/env bash
# The CUDA one-row GEMV (engine/kernels/w4gemv_cuda.py) on the device, in one call:
#
#     run (carry [".whl"]):  bash bench/device/cuda_gemv.sh
#
# 1. its GPU tests (every tiling of every E2B shape against the reference, each variant against
#    the Triton kernel, a PDL graph of chained products, the tuning's round trip, the bulk-copy
#    tilings against the register tilings bit for bit);
# 2. the decode step of every bucket with GPURIG_CUDA_GEMV 0 and 1, back to back (ab.sh steps);
#    the 1-row step is the one it changes;
# 3. the tilings it tuned on this card (the tuning cache's file, for engine/kernels/configs);
# 4. the CUDA chain probe (bench.engine.cuda_chain_probe), where the call has time left.
# $OUT gets gemv_cuda_tests.log, steps_0.json, steps_1.json, tuned_<gpu>.json, cuda_chain.json
# and probe.log. CUDA_GEMV_BUDGET_S (default 570) is the call's time: the A/B gets what the
# tests leave, at most 300 s, and the probe what is left after it.
set -uo pipefail
: "${OUT:?cuda_gemv.sh runs on the device machine, which sets OUT}"
start=$SECONDS
source bench/device/pre.sh || exit 1
cache=$(mktemp -d)
export GPURIG_KERNEL_CACHE=$cache  # a fresh cache: this call's tuning is what comes back
timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu \
    tests/kernels/test_kernels_w4gemv_cuda.py tests/kernels/test_kernels_w4gemv_bulk.py \
    > "$OUT/gemv_cuda_tests.log" 2>&1
echo "tests rc=$?"
tail -4 "$OUT/gemv_cuda_tests.log"
budget=${CUDA_GEMV_BUDGET_S:-570}
ab_s=$((budget - (SECONDS - start) - 20)); [ "$ab_s" -gt 300 ] && ab_s=300
timeout "$ab_s" bash bench/device/ab.sh GPURIG_CUDA_GEMV "0 1" steps
for f in "$cache"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/tuned_$(basename "$f")"; done
left=$((budget - (SECONDS - start)))
if [ "$left" -gt 90 ]; then
    timeout "$left" python3 -m bench.engine.cuda_chain_probe --out "$OUT/cuda_chain.json" \
        > "$OUT/probe.log" 2>&1
    echo "probe rc=$?"
    grep -v "^tuned" "$OUT/probe.log" | tail -12
else
    echo "probe skipped: ${left}s left"
fi

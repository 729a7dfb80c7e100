#!/usr/bin/env bash
# The CUDA GEMV (engine/kernels/w4gemv_cuda.py) and the chain probe on the device, in one call:
#
#     run (carry [".whl"]):  bash bench/device/cuda_gemv.sh
#
# 1. its GPU tests (every tiling of every E2B shape against the reference, each variant against
#    the Triton kernel, a PDL graph of chained products, the tuning's round trip, the bulk-copy
#    tilings against the register tilings bit for bit);
# 2. the CUDA chain probe (bench.engine.cuda_chain_probe): the chains of the GEMV's kinds of
#    tiling and the persistent bulk flow against the Triton GEMV's chain;
# 3. the decode step of every bucket with GPURIG_CUDA_GEMV 0 and 1, back to back (ab.sh steps);
#    the 1-row step is the one it changes;
# 4. the tilings it tuned on this card (the tuning cache's file, for engine/kernels/configs).
# $OUT gets gemv_cuda_tests.log, cuda_chain.json, probe.log, steps_0.json, steps_1.json and
# tuned_<gpu>.json. CUDA_GEMV_BUDGET_S (default 570) is the call's time: the probe gets at most
# 200 s, the A/B what is left (at most 300 s). CUDA_GEMV_PARTS (default "tests probe ab") picks
# parts: "tests probe" and then "ab" split it over two calls where one is short of time.
set -uo pipefail
: "${OUT:?cuda_gemv.sh runs on the device machine, which sets OUT}"
start=$SECONDS
source bench/device/pre.sh || exit 1
cache=$(mktemp -d)
export GPURIG_KERNEL_CACHE=$cache  # a fresh cache: this call's tuning is what comes back
parts=" ${CUDA_GEMV_PARTS:-tests probe ab} "
if [[ $parts == *" tests "* ]]; then
    timeout 200 python3 -m pytest -q -n 0 -p no:cacheprovider -m gpu \
        tests/kernels/test_kernels_w4gemv_cuda.py tests/kernels/test_kernels_w4gemv_bulk.py \
        tests/kernels/test_kernels_w4gemv_rows.py \
        > "$OUT/gemv_cuda_tests.log" 2>&1
    echo "tests rc=$?"
    tail -4 "$OUT/gemv_cuda_tests.log"
fi
if [[ $parts == *" probe "* ]]; then
    timeout 200 python3 -m bench.engine.cuda_chain_probe --out "$OUT/cuda_chain.json" \
        > "$OUT/probe.log" 2>&1
    echo "probe rc=$?"
    grep -v "^tuned" "$OUT/probe.log" | tail -22
fi
if [[ $parts == *" ab "* ]]; then
    budget=${CUDA_GEMV_BUDGET_S:-570}
    ab_s=$((budget - (SECONDS - start) - 20)); [ "$ab_s" -gt 300 ] && ab_s=300
    if [ "$ab_s" -gt 60 ]; then
        timeout "$ab_s" bash bench/device/ab.sh GPURIG_CUDA_GEMV "0 1" steps
    else
        echo "A/B skipped: ${ab_s}s left"
    fi
fi
for f in "$cache"/*.json; do [ -f "$f" ] && cp "$f" "$OUT/tuned_$(basename "$f")"; done

#!/usr/bin/env bash
# The step's chain cost by kind of kernel and the shared-memory carveout, in one device call:
#
#     run (carry [".whl"]):  bash bench/device/carveout.sh
#
# 1. bench.engine.step_ablation at depth 600 for the 1- and 8-row buckets (what each kind of
#    kernel costs in the chain), then the whole step under carveouts 100, 0 and 50
#    ($OUT/ablation.json);
# 2. if a carveout lowers the 1-row step by more than 1%, the sweep at concurrency 1 and 8 with
#    the driver's choice and with it, back to back (ab.sh; $OUT/sweep_<value>/).
# CARVEOUT_SWEEP=0 skips 2.
set -uo pipefail
: "${OUT:?carveout.sh runs on the device machine, which sets OUT}"
source bench/device/pre.sh || exit 1
timeout 200 python3 -m bench.engine.step_ablation --ckpt "$GPURIG_BENCH_CKPT" --rows 1,8 \
    --depth 600 --carveouts 100,0,50 --out "$OUT/ablation.json" 2>&1 | grep -iv warn | tail -16
[ -f "$OUT/ablation.json" ] || { echo "no ablation.json"; exit 1; }
best=$(python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
whole = d['ablation']['rows_1']['whole_us']; \
c = {p: v['rows_1'] for p, v in d.get('carveouts', {}).items()}; \
p = min(c, key=c.get) if c else None; \
print(p if p is not None and c[p] < 0.99 * whole else '')" "$OUT/ablation.json")
if [ -z "$best" ] || [ "${CARVEOUT_SWEEP:-1}" = 0 ]; then
    echo "no carveout lowers the 1-row step by more than 1% (or the sweep is off)"
    exit 0
fi
echo "carveout $best lowers the 1-row step: the sweep at c = 1 and 8"
AB_CONC=1,8 AB_REPEATS=2 timeout 330 bash bench/device/ab.sh GPURIG_CARVEOUT "driver $best" sweep

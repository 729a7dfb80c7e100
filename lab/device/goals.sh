#!/usr/bin/env bash
# Every figure of issue 26's goals that comes through the product, in one device call, on the
# machine as a user gets it (no tiles copied: a card without its own reads those of its kind):
#
#     run (carry [".whl"]):  bash lab/device/goals.sh
#
# 1. `gpurig engine serve` ready from an empty Triton cache and again warm (the engine in its
#    own process, the default on CUDA), once more with the engine in the server's process, and
#    each first request against its warm time to first token (lab.engine.cold_start);
# 2. the sweep: E2B shapes, 4-bit embeddings, input 512, 128 new tokens, concurrency
#    1 / 4 / 8 / 16, 3 repeats (lab.sweep_e2b);
# 3. the decode step of every bucket, for the 8-row step against the 1-row step
#    (lab.engine.batch_bench throughput);
# 4. (part gemm) the int4 product's table at 1, 8 and 16 rows (lab.engine.gemm_bench);
# 5. (part long) the 8k / 32k / 131k prompts capped and uncapped (lab.engine.long_prompt all).
# $OUT gets cold_start.json, sweep/{REPORT.md,results.json,roofline.json}, steps.json,
# gemm.{json,md}, long/ and goals.md (every goal judged from them: lab.engine.goals);
# GOALS_PARTS="start sweep steps" (the default, about 4 minutes on an H100) picks parts; the
# other two fit a second call: GOALS_PARTS="gemm long" (about 6 minutes).
set -uo pipefail
: "${OUT:?goals.sh runs on the device machine, which sets OUT}"
source lab/device/pre.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
for part in ${GOALS_PARTS:-start sweep steps}; do
    case $part in
    start)
        timeout 240 python3 -m lab.engine.cold_start --ckpt "$GPURIG_BENCH_CKPT" \
            --out "$OUT/cold_start.json" --variants cold,warm,warm_in_process,warm \
            --lengths 54,512,1024,2048,4096 > /tmp/goals_start.log 2>&1
        echo "start rc=$?"
        cut -c1-400 /tmp/goals_start.log | tail -6 ;;
    sweep)
        rm -rf /tmp/goals_sweep
        timeout 300 python3 -m lab.sweep_e2b --emb4 --ckpt "$GPURIG_BENCH_CKPT" \
            --input-lens 512 --concurrency 1,4,8,16 --repeats 3 --output-len 128 \
            --out /tmp/goals_sweep > /tmp/goals_sweep.log 2>&1
        echo "sweep rc=$?"
        mkdir -p "$OUT/sweep"
        for f in REPORT.md results.json roofline.json; do
            cp "/tmp/goals_sweep/sweep/$f" "$OUT/sweep/" 2>/dev/null
        done
        grep -A8 "^## Means over repeats" /tmp/goals_sweep/sweep/REPORT.md 2>/dev/null \
            || tail -20 /tmp/goals_sweep.log ;;
    steps)
        timeout 200 python3 -m lab.engine.batch_bench throughput --ckpt "$GPURIG_BENCH_CKPT" \
            --conc 8 --out "$OUT/steps.json" > /tmp/goals_steps.log 2>&1
        echo "steps rc=$?"
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
print([(b['rows'], b['step_us']) for b in d['buckets']]); \
print('at depth', [(b['rows'], b['step_us']) for b in d.get('buckets_at_depth', [])])" \
            "$OUT/steps.json" || tail -20 /tmp/goals_steps.log ;;
    gemm)
        timeout 200 python3 -m lab.engine.gemm_bench --rows 1,8,16 --budget-s 180 \
            --out-md "$OUT/gemm.md" --out-json "$OUT/gemm.json" > /tmp/goals_gemm.log 2>&1
        echo "gemm rc=$?"
        tail -3 /tmp/goals_gemm.log ;;
    long)
        timeout 330 python3 -m lab.engine.long_prompt all --out "$OUT/long" \
            > /tmp/goals_long.log 2>&1
        echo "long rc=$?"
        tail -12 /tmp/goals_long.log | cut -c1-300 ;;
    *) echo "goals.sh: unknown part $part (start, sweep, steps, gemm, long)" >&2; exit 2 ;;
    esac
done
python3 -m lab.engine.goals "$OUT" --out "$OUT/goals.md"

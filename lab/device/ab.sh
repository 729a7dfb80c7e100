#!/usr/bin/env bash
# One device call that compares engine switches through the product: for each VALUE of the
# GPURIG_* variable NAME, the issue's sweep (E2B shapes, 4-bit embeddings, input 512, 128 new
# tokens, concurrency 1/4/8/16, 3 repeats) and the decode step of every bucket
# (lab.engine.batch_bench throughput), back to back on the same machine, results under $OUT.
#
#     run (carry [".whl"]):  bash lab/device/ab.sh GPURIG_PDL "0 1" [sweep] [steps]
#
# NAME TREE compares code instead of a switch: each VALUE is a folder of the repo holding an
# engine/ package that is imported in place of this tree's ("." is this tree), e.g. the commit
# before a change: `git archive HEAD engine | tar -x -C .ab/base` (ignored, carried):
#     run (carry [".whl", ".ab"]):  bash lab/device/ab.sh TREE ".ab/base ."
#
# NAME ENV compares sets of switches: each VALUE is "base" (the defaults) or comma-separated
# GPURIG_*=value settings, e.g. "base GPURIG_PDL=0 GPURIG_ASYNC_PROMPTS=0"; its label is
# the setting with "=" and "," made "-" and "_".
#
# AB_CONC=1,8,16 and AB_REPEATS=2 sweep fewer cells (a shorter call).
# steps: each bucket's graph on the rows it last ran, and on rows 600 tokens deep (the sweep's
# attention). Parts default to both. $OUT gets, per value, sweep_<value>/ (REPORT.md, results.json,
# roofline.json) and steps_<value>.json: 4 files a value, so two values fit the 8 files a call
# brings back. Prints each value's tables.
set -uo pipefail
name=${1:?"name a GPURIG_* variable, e.g. GPURIG_PDL"}
values=${2:?"give the values to compare, e.g. \"0 1\""}
shift 2
parts=${*:-sweep steps}
case $name in GPURIG_* | TREE | ENV) ;; *) echo "ab.sh: $name is not a GPURIG_* variable, TREE or ENV" >&2; exit 2 ;; esac
: "${OUT:?ab.sh runs on the device machine, which sets OUT}"
source lab/device/pre.sh || exit 1
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)  # absolute: a tree's runs start in its folder
gpu=$(python3 -c "from engine.kernels.tuning import gpu_key; print(gpu_key(0))")
trees=.
[ "$name" = TREE ] && trees=$values
for tree in $trees; do  # an H100 takes the H200's tilings
    for f in "$tree"/engine/kernels/configs/*NVIDIA_H200.json; do
        [ -f "${f/NVIDIA_H200/$gpu}" ] || cp "$f" "${f/NVIDIA_H200/$gpu}"
    done
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for value in $values; do
    # python -m puts the working folder first on the path: a tree's runs start in it, so its
    # engine/ is the one imported (bench/ comes from this tree, through PYTHONPATH)
    if [ "$name" = TREE ]; then
        [ -d "$value/engine" ] || { echo "ab.sh: $value has no engine/ package" >&2; exit 2; }
        # (a variable naming the tree: `set -u` refuses to expand an empty array)
        here=$value setting=(GPURIG_AB_TREE="$value")
        label=$(basename "$value"); [ "$value" = . ] && label=head
    elif [ "$name" = ENV ]; then
        here=. label=$value setting=(GPURIG_AB_BASE=1)
        if [ "$value" != base ]; then
            IFS=, read -ra setting <<< "$value"
            for s in "${setting[@]}"; do
                case $s in GPURIG_*=*) ;; *) echo "ab.sh: $s is not GPURIG_*=value" >&2; exit 2 ;; esac
            done
            label=$(echo "$value" | tr '=,' '-_')
        fi
    else
        here=. setting=("$name=$value")
        label=$value
    fi
    (cd "$here" && python3 -c "import engine; print('$label: engine from', engine.__file__)")
    for part in $parts; do
        case $part in
        sweep)
            rm -rf /tmp/ab_sweep
            (cd "$here" && env "${setting[@]}" timeout 300 python3 -m lab.sweep_e2b --emb4 \
                --ckpt "$GPURIG_BENCH_CKPT" --input-lens 512 --concurrency "${AB_CONC:-1,4,8,16}" \
                --repeats "${AB_REPEATS:-3}" --output-len 128 --out /tmp/ab_sweep > /tmp/ab_sweep.log 2>&1)
            echo "$name=$label sweep rc=$?"
            mkdir -p "$OUT/sweep_$label"
            for f in REPORT.md results.json roofline.json; do
                cp "/tmp/ab_sweep/sweep/$f" "$OUT/sweep_$label/" 2>/dev/null
            done
            grep -A7 "^## Means over repeats" "/tmp/ab_sweep/sweep/REPORT.md" 2>/dev/null \
                || tail -20 /tmp/ab_sweep.log ;;
        steps)
            (cd "$here" && env "${setting[@]}" timeout 240 python3 -m lab.engine.batch_bench \
                throughput --ckpt "$GPURIG_BENCH_CKPT" --conc 8 --out "$OUT/steps_$label.json" \
                > /tmp/ab_steps.log 2>&1)
            echo "$name=$label steps rc=$?"
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
print([(b['rows'], b['step_us']) for b in d['buckets']]); \
print('at depth', [(b['rows'], b['step_us']) for b in d.get('buckets_at_depth', [])])" \
                "$OUT/steps_$label.json" \
                || tail -20 /tmp/ab_steps.log ;;
        *) echo "ab.sh: unknown part $part (sweep, steps)" >&2; exit 2 ;;
        esac
    done
done
# more than the 8 files a call brings back: one archive of them all
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -czf /tmp/ab_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/ab_results.tgz "$OUT/"
    echo "results in $OUT/ab_results.tgz"
fi

#!/usr/bin/env bash
# One device call that compares whole trees of the repo through the product: for each TREE (a
# folder holding a checkout; "." is this one), that tree's own sweep entry (E2B shapes, 4-bit
# embeddings, input 512, 128 new tokens, concurrency 1/4/8/16, 3 repeats: `gpurig engine serve`
# started by its lifecycle tools) and its decode-step bench (batch_bench throughput), each run
# with only that tree on PYTHONPATH, back to back on the same machine.
#
# Why whole trees and not ab.sh TREE (which swaps engine/ only): a redesign moves code between
# the packages (the server's composition root left mcp_server/ for engine/server, the lab left
# bench/), so an old engine/ beside new front doors would not start.
#
#     here:  git archive e67ed01 ':!bench/results' | (mkdir -p .ab/base && tar -x -C .ab/base)
#     run (carry [".whl", ".ab"]):  bash lab/device/ab_trees.sh ".ab/base ." [sweep] [steps]
#
# AB_CONC=1,8,16 and AB_REPEATS=2 sweep fewer cells. $OUT gets, per tree, sweep_<label>/
# (REPORT.md, results.json) and steps_<label>.json; prints each tree's tables.
set -uo pipefail
trees=${1:?"give the trees to compare, e.g. \".ab/base .\""}
shift
parts=${*:-sweep steps}
: "${OUT:?ab_trees.sh runs on the device machine, which sets OUT}"
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
ckpt=/tmp/gpurig-e2b-ckpt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for tree in $trees; do
    [ -d "$tree/engine" ] || { echo "ab_trees.sh: $tree has no engine/ package" >&2; exit 2; }
    root=$(cd "$tree" && pwd)
    label=$(basename "$tree"); [ "$tree" = . ] && label=head
    # the tree's own lab: lab/ after the redesign, bench/ before it
    if [ -f "$root/lab/sweep_e2b.py" ]; then sweep=lab.sweep_e2b steps=lab.engine.batch_bench
    else sweep=bench.sweep_e2b steps=bench.engine.batch_bench; fi
    export PYTHONPATH="/tmp/site:$root"
    gpu=$(cd "$root" && python3 -c "from engine.kernels.tuning import gpu_key; print(gpu_key(0))")
    for f in "$root"/engine/kernels/configs/*NVIDIA_H200.json; do  # an H100 takes the H200's
        [ -f "${f/NVIDIA_H200/$gpu}" ] || cp "$f" "${f/NVIDIA_H200/$gpu}"
    done
    if [ ! -f "$ckpt/config.json" ]; then
        (cd "$root" && python3 -c "from engine.checkpoint_maker import make_checkpoint as m; \
m('$ckpt', preset='e2b', seed=0, emb4=True)") || exit 1
    fi
    (cd "$root" && python3 -c "import engine; print('$label: engine from', engine.__file__)")
    for part in $parts; do
        case $part in
        sweep)
            rm -rf /tmp/ab_sweep
            (cd "$root" && timeout 300 python3 -m "$sweep" --emb4 --ckpt "$ckpt" --input-lens 512 \
                --concurrency "${AB_CONC:-1,4,8,16}" --repeats "${AB_REPEATS:-3}" \
                --output-len 128 --out /tmp/ab_sweep > /tmp/ab_sweep.log 2>&1)
            echo "$label sweep rc=$?"
            mkdir -p "$OUT/sweep_$label"
            for f in REPORT.md results.json; do cp "/tmp/ab_sweep/sweep/$f" "$OUT/sweep_$label/" 2>/dev/null; done
            grep -A7 "^## Means over repeats" /tmp/ab_sweep/sweep/REPORT.md 2>/dev/null \
                || tail -20 /tmp/ab_sweep.log ;;
        steps)
            (cd "$root" && timeout 240 python3 -m "$steps" throughput --ckpt "$ckpt" --conc 8 \
                --out "$OUT/steps_$label.json" > /tmp/ab_steps.log 2>&1)
            echo "$label steps rc=$?"
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
print([(b['rows'], b['step_us']) for b in d['buckets']]); \
print('at depth', [(b['rows'], b['step_us']) for b in d.get('buckets_at_depth', [])])" \
                "$OUT/steps_$label.json" || tail -20 /tmp/ab_steps.log ;;
        *) echo "ab_trees.sh: unknown part $part (sweep, steps)" >&2; exit 2 ;;
        esac
    done
done

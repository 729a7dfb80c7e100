# Sourced at the start of a device call (carry [".whl"]): the carried wheels into /tmp/site,
# this tree on PYTHONPATH, and the E2B-shaped checkpoint with 4-bit embeddings written once per
# machine (random weights: the real format and sizes, see engine/checkpoint_maker.py).
#     source lab/device/pre.sh && python3 -m lab.sweep_e2b --emb4 --ckpt "$GPURIG_BENCH_CKPT" ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPURIG_BENCH_CKPT=/tmp/gpurig-e2b-ckpt
if [ ! -f "$GPURIG_BENCH_CKPT/config.json" ]; then
    python3 -c "from engine.checkpoint_maker import make_checkpoint as m; \
m('$GPURIG_BENCH_CKPT', preset='e2b', seed=0, emb4=True)" || return 1
fi

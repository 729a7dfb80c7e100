#!/usr/bin/env bash
# The wheels a bench run on the lent H200 needs beyond its image (Python 3.12; the image has
# torch, triton, numpy, safetensors, tokenizers, httpx, anyio, h11, psutil, tabulate, jinja2):
# pydantic and its needs, starlette and uvicorn (the engine's server), gguf (llama.cpp's reader).
# Run here, in the repo's root; then name .whl (and .carry, if used) in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.13.4 pydantic_core==2.46.4 annotated_types typing_inspection starlette==1.10.0 \
    uvicorn==0.54.0 gguf
ls .whl
du -sh .whl

#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a machine that reaches no package index (the lent GPU
# machine has python3 with torch, triton and transformers, and nothing else of tq's): tq
# itself, and its other dependencies for CPython 3.10-3.13 on x86-64 Linux, into
# gpu-wheels/ (ignored by git; carry it with the tree: run(..., carry=["gpu-wheels"])).
# Also pytest and hypothesis for the GPU-marked tests. About 20 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=gpu-wheels
rm -rf "$dest" && mkdir -p "$dest"
py=${PY:-.venv/bin/python}
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" .
deps="typer annotated-doc rich pydantic pydantic-core annotated-types typing-inspection typing-extensions
      shellingham click markdown-it-py mdurl pygments tomli pytest pluggy iniconfig
      packaging hypothesis sortedcontainers attrs exceptiongroup"
for v in 3.10 3.11 3.12 3.13; do  # per Python version: some come compiled
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$dest" $deps
done
du -sh "$dest"

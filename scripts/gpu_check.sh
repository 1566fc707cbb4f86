#!/usr/bin/env bash
# One GPU check (under 5 minutes on one H200): install, run the GPU-marked tests, then the
# kernel benchmark under CUDA graphs. Results go to ${OUT:-gpu-results}/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
make install
.venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
.venv/bin/python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt"
.venv/bin/python scripts/gpu_bench.py --json "$out/gpu_check.json"

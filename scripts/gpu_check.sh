#!/usr/bin/env bash
# One GPU check (a few minutes on one H200): install, run the GPU-marked tests, then the
# full benchmark on CUDA (kernels under CUDA graphs against F.linear fp16, with GB/s
# against the device's bandwidth; conversion on the GPU). Results go to ${OUT:-gpu-results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
make install
.venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
.venv/bin/python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt"
.venv/bin/tq bench --device cuda --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.txt"

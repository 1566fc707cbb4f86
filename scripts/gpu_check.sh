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

# vLLM on CUDA (tests/test_vllm.py: tq tokens = tq_cli.load tokens, TP=2 = TP=1 when two
# GPUs are visible, the refusals). scripts/vllm_env.sh installs vLLM's CUDA build into
# .venv-vllm, which needs the package index (several GB); where it cannot be reached, or
# VLLM_CHECK=0, this section says so and is skipped.
if [ "${VLLM_CHECK:-1}" = "1" ]; then
  if VLLM_VENV=.venv-vllm bash scripts/vllm_env.sh >"$out/vllm_env.txt" 2>&1; then
    .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm.py 2>&1 | tee "$out/vllm_tests.txt"
  else
    echo "vllm: could not build .venv-vllm (see $out/vllm_env.txt); vLLM check skipped" \
      | tee "$out/vllm_tests.txt"
  fi
fi
# Conversion: the whole fit runs on the GPU with --device cuda. A synthetic bf16
# Llama-3.2-1B-shaped model (4 layers; no download needed), converted on CUDA and on this
# machine's CPUs, each against a plain safetensors load+save of the same shards, with the
# child's peak RSS; then tq's conversion tests on CUDA tensors.
.venv/bin/python scripts/bench_convert.py --synthetic llama-3.2-1b --layers 4 --device cuda \
  --json "$out/convert-cuda.json" 2>&1 | tee "$out/convert-cuda.txt"
.venv/bin/python scripts/bench_convert.py --synthetic llama-3.2-1b --layers 4 --device cpu \
  --json "$out/convert-cpu.json" 2>&1 | tee "$out/convert-cpu.txt"
.venv/bin/python -m pytest -q tests/test_native_fit.py -k cuda 2>&1 | tee "$out/fit_cuda_tests.txt"

#!/usr/bin/env bash
# One GPU check (about ten minutes on one H100 or H200): install, run the GPU-marked
# tests, then the full benchmark on CUDA (kernels under CUDA graphs against F.linear fp16, with GB/s
# against the device's bandwidth; conversion on the GPU). Results go to ${OUT:-gpu-results}.
#
# The lent GPU machine reaches no package index; it has python3 with torch, triton and
# transformers. Run scripts/gpu_wheels.sh here first and carry gpu-wheels/ with the tree:
# tq and the rest of its dependencies are then installed from it into a venv that sees
# the system's torch. Without gpu-wheels/ this falls back to `make install`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
if [ -d gpu-wheels ]; then
  python3 -m venv --system-site-packages .venv-gpu
  .venv-gpu/bin/python -m pip install -q --no-index --find-links gpu-wheels tq pytest \
    hypothesis
  PY=.venv-gpu/bin/python
else
  make install
  PY=.venv/bin/python
fi
TQ="$PY -m tq_cli"
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
$PY -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt"
$TQ bench --device cuda --json "$out/bench-cuda.json" 2>&1 | tee "$out/bench-cuda.txt"

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
$PY scripts/bench_convert.py --synthetic llama-3.2-1b --layers 4 --device cuda \
  --json "$out/convert-cuda.json" 2>&1 | tee "$out/convert-cuda.txt"
$PY scripts/bench_convert.py --synthetic llama-3.2-1b --layers 4 --device cpu \
  --json "$out/convert-cpu.json" 2>&1 | tee "$out/convert-cpu.txt"
$PY -m pytest -q tests/test_native_fit.py -k cuda 2>&1 | tee "$out/fit_cuda_tests.txt"
# The default (self-calibrated, streamed block by block) conversion at Llama-3-8B layer
# shapes, 2 layers, on CUDA and on this machine's CPUs: time and peak host RSS.
$PY scripts/bench_convert.py --synthetic llama-3-8b --layers 2 --device cuda \
  --json "$out/convert-8b-cuda.json" 2>&1 | tee "$out/convert-8b-cuda.txt"
$PY scripts/bench_convert.py --synthetic llama-3-8b --layers 2 --device cpu \
  --json "$out/convert-8b-cpu.json" 2>&1 | tee "$out/convert-8b-cpu.txt"
# GPTQ (the default conversion's fit) on the GPU against the native CPU loop: one
# Llama-3-8B-sized layer (4096 x 4096) with a random Hessian, seconds per solve.
$PY - <<'EOF' 2>&1 | tee "$out/gptq_cuda.txt"
import time, torch
from tq_cli.quant import gptq
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
w = torch.randn(4096, 4096); x = torch.randn(8192, 4096); h = (x.T @ x).double() / 8192
rot = make_rotation(RotationSpec(kind="hadamard"), 4096, 128)
for dev in ("cuda", "cpu"):
    args = (w.to(dev), h.to(dev), QuantSpec(bits=4), rot)
    gptq.quantize_calibrated(*args, device=dev)  # warm-up
    t = time.perf_counter(); gptq.quantize_calibrated(*args, device=dev)
    if dev == "cuda": torch.cuda.synchronize()
    print(f"gptq 4096x4096 4-bit on {dev}: {time.perf_counter() - t:.2f} s")
EOF
# KV cache attention on the codes: the Triton kernels against the torch reference on CUDA,
# then decode time per token against transformers' DynamicCache at 2k, 8k and 32k tokens
# (random SmolLM2-shaped model, cache bytes read per step against the copy rate).
$PY -m pytest -q tests/test_kv_triton.py 2>&1 | tee "$out/kv_triton_tests.txt"
$TQ bench --device cuda --section kv --json "$out/bench-kv-cuda.json" 2>&1 \
    | tee "$out/bench-kv-cuda.txt"

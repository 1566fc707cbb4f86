"""Shared fixtures: tiny random models built in code, and the real models from wheels."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is first imported, and transformers may import
# it from any test module; set it before any of them, so the kernel tests run the
# Triton interpreter on a machine without CUDA whatever order the modules load in.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from tinymodels import build_tiny_bert, build_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tq_cli.load compiles generate()'s decode step by default on the CPU (tens of seconds the
# first time); tests load eagerly unless they ask (tests/test_compiled.py).
os.environ.setdefault("TQ_COMPILE", "0")

# The tq command line pausing after every finished tensor (to kill or race a conversion).
SLOW_TQ = Path(__file__).resolve().parent / "slow_tq.py"


@pytest.fixture(params=["fp32", "bf16"])
def cpu_gemm(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU kernel's prefill GEMM products (`set_gemm_precision`) for one test: float32
    ones match a dequantized model to float32 rounding, bf16 ones (the default where the
    CPU has bf16 dot products) to bf16's."""
    from tq_kernels import cpu

    cpu.set_gemm_precision(request.param)
    yield request.param
    cpu.set_gemm_precision(None)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      header_patch: dict | None = None) -> None:
    """A safetensors file written by hand, so tests can make it lie."""
    from tq_cli.io.safetensors_reader import TORCH_TO_ST
    from tq_cli.io.writer import tensor_bytes

    header: dict = {}
    blobs = []
    pos = 0
    for name, t in tensors.items():
        b = bytes(tensor_bytes(t))
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    for name, patch in (header_patch or {}).items():
        header[name].update(patch)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    """A one-file model folder with one convertible weight and one kept tensor."""
    folder = tmp_path / "small"
    folder.mkdir()
    torch.manual_seed(1)
    write_safetensors(folder / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 96),
        "model.norm.weight": torch.ones(96),
    })
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from tq_cli.demo_model import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="session")
def minilm() -> Path:
    from realmodels import minilm_folder

    return minilm_folder()

"""model.dequantize() on a tq checkpoint loaded through transformers gives a plain model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tq_cli  # noqa: F401  (registers the turboquant quantizer with transformers)
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.runtime.tq_linear import TQLinear


@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
def test_dequantize_then_save_pretrained_is_an_ordinary_model(
        rotation: str, tiny_llama: Path, tmp_path: Path, cpu_gemm: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tq"
    convert(tiny_llama, folder, ConvertSpec(quant=QuantSpec(bits=3, group_size=64),
                                            rotation=RotationSpec(kind=rotation)))
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        quantized_logits = model(ids).logits
    assert any(isinstance(m, TQLinear) for m in model.modules())

    plain = model.dequantize()
    assert not any(isinstance(m, TQLinear) for m in plain.modules())
    assert not hasattr(plain, "tq")
    assert not hasattr(plain.config, "quantization_config")
    assert plain.model.layers[0].self_attn.q_proj.__class__ is torch.nn.Linear
    with torch.no_grad():
        plain_logits = plain(ids).logits
    # 48 rows: the CPU kernel's GEMM path, whose bf16 products round to 2^-9 (three times)
    tol = {"atol": 1e-4, "rtol": 1e-4} if cpu_gemm == "fp32" else {
        "atol": 2.0**-6 * float(plain_logits.abs().max()), "rtol": 0.0}
    torch.testing.assert_close(plain_logits, quantized_logits, **tol)

    saved = tmp_path / "plain"
    plain.save_pretrained(saved)
    config = json.loads((saved / "config.json").read_text())
    assert "quantization_config" not in config
    from safetensors import safe_open

    with safe_open(str(next(saved.glob("*.safetensors"))), "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if k.startswith("tq.") or ".weight." in k]

    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert not any(isinstance(m, TQLinear) for m in reloaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, plain_logits)

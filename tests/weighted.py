"""Test helper: a checkpoint's output-aware error under a calibration's Hessians."""

from __future__ import annotations

from pathlib import Path

from tq_cli.io.calibration import Calibration
from tq_cli.io.checkpoint import Checkpoint
from tq_cli.io.safetensors_reader import open_source, read_tensor
from tq_cli.quant.gptq import relative_weighted_error
from tq_cli.quant.grouped import dequantize


def is_head(entry: dict) -> bool:
    """A manifest entry of lm_head stored quantized (`--head-bits`: the weight-only fit,
    no calibration Hessian)."""
    return entry.get("head") is True


def weighted_errors(folder: Path, calib: Calibration) -> dict[str, float]:
    """Each converted tensor's tr(dW H dW^T) / tr(W H W^T) under `calib` (not the head's:
    the calibration has no Hessian for it)."""
    ck = Checkpoint(folder)
    src = open_source(Path(ck.manifest["source"]["path"]))
    out = {}
    for t in ck.manifest["tensors"]:
        if t["action"] != "quantize" or is_head(t):
            continue
        q = ck.quantized(t["name"])  # in the original basis, column scales included
        w = read_tensor(src.tensors[t["name"]]).float()
        h = calib.hessian(t["name"])
        assert h is not None
        out[t["name"]] = relative_weighted_error(w, dequantize(q), h)
    return out

"""Quantize one tensor the way `convert` does: calibrated when the calibration file has
statistics for it, data-free otherwise (with the reason, for a warning).

Shared by the conversion pipeline and by the `--target-bits` pre-pass, so the errors the
bit allocation sees are those of the quantization that will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tq_cli.io.calibration import Calibration
from tq_cli.io.safetensors_reader import TensorInfo, read_tensor
from tq_cli.quant.gptq import (
    CalibrationUnusableError,
    quantize_calibrated,
    relative_weighted_error,
    rotate_hessian,
    weighted_error,
)
from tq_cli.quant.grouped import QuantizedTensor, dequantize_rotated, quantize_rotated
from tq_cli.quant.rotation import Rotation
from tq_cli.quant.spec import QuantSpec


@dataclass(frozen=True)
class CalibOptions:
    """A calibration file and how GPTQ uses it."""

    calibration: Calibration
    damp: float = 0.01
    act_order: bool = False


@dataclass(frozen=True)
class TensorResult:
    q: QuantizedTensor
    record: dict[str, Any]  # extra manifest fields for this tensor
    weighted_error: float | None  # tr(dW H dW^T) with the mean H, when calibrated
    fallback: str | None  # why a tensor with --calib was quantized data-free


def quantize_tensor(name: str, w_rot: torch.Tensor, spec: QuantSpec, rotation: Rotation,
                    device: torch.device, calib: CalibOptions | None) -> TensorResult:
    if calib is None:
        return TensorResult(quantize_rotated(w_rot, spec, rotation, device), {}, None, None)
    h = calib.calibration.hessian(name)
    reason = None
    if h is None:
        reason = "saw no calibration tokens"
    else:
        try:
            h_rot = rotate_hessian(h, rotation)
            q = quantize_calibrated(w_rot, h_rot, spec, rotation, damp=calib.damp,
                                    act_order=calib.act_order, device=device)
            w_hat = dequantize_rotated(q)
            werr = weighted_error(w_rot, w_hat, h_rot)
            rec = {"calibrated": True,
                   "weighted_rel_error": relative_weighted_error(w_rot, w_hat, h_rot)}
            return TensorResult(q, rec, werr, None)
        except CalibrationUnusableError as e:
            reason = str(e)
    q = quantize_rotated(w_rot, spec, rotation, device)
    return TensorResult(q, {"calibrated": False, "fallback": reason}, None, reason)


def read_weight(info: TensorInfo) -> torch.Tensor:
    """A source weight in float32 with NaN/Inf as 0, as the pipeline quantizes it under
    --allow-nonfinite (pre-passes that only score tensors never fail on them)."""
    w = read_tensor(info).to(torch.float32)
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w))

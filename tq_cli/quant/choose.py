"""Choose and run the fit of one tensor the way `convert` does: calibrated (GPTQ) when the
calibration statistics cover it, data-free otherwise (with the reason, for a warning).

Shared by the conversion pipeline and by the `--target-bits` pre-pass, so the errors the
bit allocation sees are those of the quantization that will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

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


class Hessians(Protocol):
    """Where the input statistics come from (a calibration file: tq_cli.io.calibration)."""

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        """E[x x^T] of the tensor's input, or None when it saw no calibration tokens."""

    def unusable(self, tensor_name: str) -> str | None:
        """Why its statistics are too thin to fit with (an expert routed few tokens)."""


@dataclass(frozen=True)
class CalibOptions:
    """The calibration statistics and how GPTQ uses them."""

    calibration: Hessians
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
    reason = "saw no calibration tokens" if h is None else calib.calibration.unusable(name)
    if h is not None and reason is None:
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

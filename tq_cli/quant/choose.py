"""Choose and run the fit of one tensor the way `convert` does: calibrated (GPTQ) when the
calibration statistics cover it, data-free otherwise (with the reason, for a warning).

Shared by the conversion pipeline and by the `--target-bits` pre-pass, so the errors the
bit allocation sees are those of the quantization that will run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tq_cli.quant.colscale import scale_hessian_
from tq_cli.quant.gptq import (
    CalibrationUnusableError,
    PreparedHessian,
    fit_calibrated,
    prepare_hessian,
    rotate_hessian_,
)
from tq_cli.quant.grouped import QuantizedTensor, quantize_rotated
from tq_cli.quant.prepare import PreparedWeight, prepare_weight, with_scales
from tq_cli.quant.rotation import Rotation
from tq_cli.quant.spec import QuantSpec


class Hessians(Protocol):
    """Where the input statistics come from (a calibration file: tq_cli.io.calibration)."""

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        """E[x x^T] of the tensor's input, or None when it saw no calibration tokens: a
        float32 (or float64) copy the caller owns (the fit transforms it in place)."""

    def unusable(self, tensor_name: str) -> str | None:
        """Why its statistics are too thin to fit with (an expert routed few tokens)."""

    def group(self, tensor_name: str) -> str | None:
        """The key the tensor shares with the others that read the same input."""


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
    row_errors: torch.Tensor | None = None  # (dW H dW^T)_ii per row, when calibrated


def quantize_tensor(name: str, prepared: PreparedWeight, spec: QuantSpec,
                    rotation: Rotation, device: torch.device,
                    calib: CalibOptions | None) -> TensorResult:
    """Fit one weight prepared by `prepare_weight` (scaled and rotated under `spec` and
    `rotation`): calibrated when `calib` has a usable H for `name`, data-free otherwise.
    The result stores the column scales and its error on the weight as read."""
    if (spec.col_scale != "none") != (prepared.col_scale is not None):
        raise ValueError(f"tensor '{name}': spec col_scale '{spec.col_scale}' but column "
                         f"scales {'given' if prepared.col_scale is not None else 'missing'}")
    w_rot = prepared.w_rot
    if calib is None:
        return TensorResult(with_scales(quantize_rotated(w_rot, spec, rotation, device),
                                        prepared), {}, None, None)
    h = calib.calibration.hessian(name)
    reason = "saw no calibration tokens" if h is None else calib.calibration.unusable(name)
    if h is not None and reason is None:
        try:
            ph = _prepared(name, h, rotation, device, calib, prepared.col_scale)
            fitted = fit_calibrated(w_rot, ph, spec, rotation, damp=calib.damp,
                                    act_order=calib.act_order, device=device)
            # tr(dW' H' dW'^T) = tr(dW H dW^T): the weighted error needs no correction.
            rec = {"calibrated": True, "weighted_rel_error": fitted.relative_weighted_error}
            return TensorResult(with_scales(fitted.q, prepared), rec, fitted.weighted_error,
                                None, fitted.row_errors)
        except CalibrationUnusableError as e:
            reason = str(e)
    q = quantize_rotated(w_rot, spec, rotation, device)
    return TensorResult(with_scales(q, prepared), {"calibrated": False, "fallback": reason},
                        None, reason)


def fit_weight(name: str, w: torch.Tensor, spec: QuantSpec, rotation: Rotation,
               device: torch.device, calib: CalibOptions | None, *,
               owned: bool = False) -> TensorResult:
    """`prepare_weight` then `quantize_tensor`: one float32 weight [out, in] as read, fitted
    the way `convert` fits it."""
    return quantize_tensor(name, prepare_weight(w, spec, rotation, owned=owned), spec,
                           rotation, device, calib)


# Rotated, checked and factored Hessians of the last few input groups: q, k and v (gate and
# up) read one input, arrive one after another, and need the same R^T H R and Cholesky
# factor. Kept on the calibration object itself, so they go when it goes (for a
# 14336-wide input one entry is 2.5 GB), keyed by the group, the rotation and the options.
# A tensor whose columns are scaled has its own H' = diag(t) H diag(t), which no other
# tensor reads: it is prepared in place on its own copy of H and kept in a slot of its
# own only until another tensor asks (`--target-bits` fits one tensor at each width in a
# row), the old entry dropped before the new one is made; not at all where the
# calibration says no tensor asks twice (`asks_again = False`: the streamed one), so it
# goes with the fit (1.6 GB at n = 14336, alive while the tensor is packed and written).
_PREPARED_LOCK = threading.Lock()
_PREPARED_KEEP = 2
# The precision of a conversion's Hessian work (rotation, Cholesky, the scale refit), as in
# the GPTQ reference implementation: H is stored in float32, and float64 doubled the
# memory (1.6 GB per copy of a 14336-wide H) and the time of every n^3 step
# (docs/decisions.md has the quality measured both ways).
FIT_DTYPE = torch.float32


def _prepared(name: str, h: torch.Tensor, rotation: Rotation, device: torch.device,
              calib: CalibOptions, col_scale: torch.Tensor | None) -> PreparedHessian:
    """`h`: the tensor's own copy of H (`Hessians.hessian` returns one)."""
    h = h.to(FIT_DTYPE)
    if col_scale is not None:
        scaled_key = (name, hash(col_scale.numpy().tobytes()), rotation.rotation_id,
                      calib.damp, calib.act_order, str(device))
        with _PREPARED_LOCK:
            slot: dict[tuple, PreparedHessian] = calib.calibration.__dict__.setdefault(
                "_tq_prepared_scaled", {})
            if scaled_key in slot:
                return slot[scaled_key]
            slot.clear()
        prepared = prepare_hessian(rotate_hessian_(scale_hessian_(h, col_scale), rotation),
                                   damp=calib.damp, act_order=calib.act_order,
                                   device=device, owned=True)
        if getattr(calib.calibration, "asks_again", True):
            with _PREPARED_LOCK:
                slot[scaled_key] = prepared
        else:  # nobody asks again: the fit may drop the factor before its refit
            prepared.owned = True
        return prepared
    group = calib.calibration.group(name)
    key = (group if group is not None else name, rotation.rotation_id, calib.damp,
           calib.act_order, str(device))
    with _PREPARED_LOCK:
        cache: OrderedDict[tuple, PreparedHessian] = calib.calibration.__dict__.setdefault(
            "_tq_prepared", OrderedDict())
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
    prepared = prepare_hessian(rotate_hessian_(h, rotation),
                               damp=calib.damp, act_order=calib.act_order, device=device,
                               owned=True)
    with _PREPARED_LOCK:
        cache[key] = prepared
        while len(cache) > _PREPARED_KEEP:
            cache.popitem(last=False)
    return prepared

"""What every fit of one weight starts with: its column scales, then its rotation.

A weight W [out, in] is fitted as W' R with W = W' diag(t) (tq_cli.quant.colscale, when the
spec scales columns) and R the tensor's rotation: w_rot = (W / t) R. The conversion's
pipeline, `--target-bits`' trial fits, the seed search and `quantize` all prepare a weight
here, so a new step before the fit is added once. Pure: no I/O, no printing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tq_cli.quant.colscale import sinkhorn_columns
from tq_cli.quant.grouped import (
    QuantizedTensor,
    quantize_rotated,
    rotate_owned,
    sq_norm,
    with_col_scale,
)
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec


@dataclass
class PreparedWeight:
    """A weight ready for a fit: w_rot = (W / t) R in float32, t (None: columns unscaled)
    and ||W||^2 of the weight as read (what the stored error is measured against)."""

    w_rot: torch.Tensor
    col_scale: torch.Tensor | None
    norm: float


def column_scales(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """t for `w` under `spec`, or None when the spec keeps columns as they are. It does not
    depend on the rotation: a seed search computes it once per tensor."""
    return None if spec.col_scale == "none" else sinkhorn_columns(w)


def prepare_weight(w: torch.Tensor, spec: QuantSpec, rotation: Rotation, *,
                   owned: bool = False, col_scale: torch.Tensor | None = None,
                   norm: float | None = None) -> PreparedWeight:
    """Scale and rotate `w` [out, in] (float32) for a fit under `spec`.

    `owned`: w is a buffer the caller gives up (the pipeline's read buffer): divided and,
    for a Hadamard rotation on the CPU, rotated in place, so no second full-size copy
    exists; otherwise w is left as it is. `col_scale` and `norm`: t and ||w||^2 where the
    caller has them already (t must be `column_scales(w, spec)`)."""
    if norm is None:
        norm = sq_norm(w)
    t = col_scale if col_scale is not None else column_scales(w, spec)
    if t is not None:
        w = w.div_(t) if owned else w / t
        owned = True  # the scaled copy is this function's own
    w_rot = rotate_owned(w, rotation) if owned else rotation.rotate_rows(w)
    return PreparedWeight(w_rot, t, norm)


def with_scales(q: QuantizedTensor, prepared: PreparedWeight) -> QuantizedTensor:
    """The fit of `prepared.w_rot` as stored: with t and its error on W itself."""
    if prepared.col_scale is None:
        return q
    return with_col_scale(q, prepared.w_rot, prepared.col_scale, prepared.norm)


def quantize(weight: torch.Tensor, spec: QuantSpec,
             rotation: RotationSpec | Rotation | None = None,
             device: torch.device | str | None = None) -> QuantizedTensor:
    """Rotate `weight` [out, in] and quantize it data-free (its columns scaled first when
    `spec.col_scale` says so)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize needs a 2-D weight, got shape {tuple(weight.shape)}")
    rot = rotation if isinstance(rotation, Rotation) else make_rotation(
        rotation or RotationSpec(kind="hadamard"), weight.shape[1], spec.group_size)
    p = prepare_weight(weight.float(), spec, rot)
    return with_scales(quantize_rotated(p.w_rot, spec, rot, device), p)

"""`--target-bits`: per-tensor bit widths that minimise the total error at an average.

A pre-pass quantizes every converted tensor at each allowed width exactly as the
conversion will (calibrated when there is calibration data), measures its error, and
`tq_cli.conversion.allocate` solves the multiple-choice knapsack: minimise the summed error subject
to the summed storage bits <= target * weights. The error is the Hessian-weighted
tr(dW H dW^T) (H the mean of x x^T) where calibration data exists, which is the layer's
output error in the same units for every layer (the HAWQ-style proxy: Dong et al. 2019,
"HAWQ", arXiv:1905.03696); without calibration it is the plain squared error ||dW||^2.
Storage counts codes, scales, codebook, outliers and the tensor's share of the rotation
material, so the achieved average is the one the manifest reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tq_cli.conversion.allocate import allocate
from tq_cli.io.writer import nbytes
from tq_cli.planning.plan import Plan
from tq_cli.quant.choose import CalibOptions, quantize_tensor, read_weight
from tq_cli.quant.grouped import storage_layout
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec


@dataclass(frozen=True)
class MixedChoice:
    bits: dict[str, int]
    record: dict[str, Any]  # what the manifest and summary report


def storage_bits(out: int, n: int, spec: QuantSpec) -> int:
    return 8 * sum(nbytes(dtype, tuple(shape))
                   for dtype, shape in storage_layout(out, n, spec).values())


def choose_bits(plan: Plan, target: float, choices: tuple[int, ...], device: torch.device,
                calib: CalibOptions | None,
                progress: Callable[[str, int, int], None] | None = None) -> MixedChoice:
    options: dict[str, dict[int, tuple[float, int]]] = {}
    numel: dict[str, int] = {}
    rotations: dict[str, Rotation] = {}
    todo = plan.converted
    for i, tp in enumerate(todo):
        assert tp.quant is not None and tp.rotation is not None
        name = tp.info.name
        out, n = tp.info.shape
        w = read_weight(tp.info)
        if tp.rotation_id:
            if tp.rotation_id not in rotations:
                rotations[tp.rotation_id] = make_rotation(tp.rotation, n, tp.block)
            rot = rotations[tp.rotation_id]
            rp = plan.rotations[tp.rotation_id]
            share = sum(plan.layout.slots[k].nbytes for k, _, _ in rp.keys) * 8 / rp.users
        else:
            rot, share = Rotation("none", n, tp.block, 0), 0.0
        w_rot = rot.rotate_rows(w)
        norm = float(w_rot.double().pow(2).sum())
        options[name] = {}
        for bits in choices:
            spec = tp.quant.model_copy(update={"bits": bits})
            res = quantize_tensor(name, w_rot, spec, rot, device, calib)
            err = res.weighted_error if res.weighted_error is not None \
                else res.q.rel_error * norm
            options[name][bits] = (err, storage_bits(out, n, spec) + round(share))
        numel[name] = tp.info.numel
        if progress:
            progress(name, i + 1, len(todo))
    alloc = allocate(options, target, numel)
    counts = {str(b): sum(1 for v in alloc.bits.values() if v == b) for b in choices}
    weights = {str(b): sum(numel[k] for k, v in alloc.bits.items() if v == b) for b in choices}
    record = {"target_bits": target, "choices": list(choices),
              "achieved_bits": alloc.bpw, "tensors_per_bits": counts,
              "weights_per_bits": weights,
              "error": "hessian-weighted" if calib is not None else "squared"}
    return MixedChoice(alloc.bits, record)

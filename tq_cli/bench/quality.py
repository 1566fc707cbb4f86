"""Quality per bit: reconstruction error of the quantizer on fixed-seed matrices.

Two kinds of matrix: Gaussian (the case the Lloyd-Max codebook is optimal for), and
heavy-tailed with a few large-magnitude input columns, as real LLM weights have
(Dettmers et al. 2022, "LLM.int8()", arXiv:2208.07339: a handful of feature dimensions
carry outliers). Every setting is quantized on the same matrices, so rows compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tq_cli.bench.metrics import Metric
from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec

SHAPE = (512, 1536)
BITS = (2, 3, 4)
ROTATIONS = ("none", "hadamard", "orthogonal")
OUTLIER_COLUMNS = 8
OUTLIER_SCALE = 10.0


@dataclass(frozen=True)
class Setting:
    label: str
    quant: QuantSpec
    rotation: str


def matrix(kind: str, shape: tuple[int, int] = SHAPE, seed: int = 0) -> torch.Tensor:
    """A fixed-seed weight-like matrix: 'gaussian' or 'heavy' (Student-t(4) with outlier
    input columns scaled by OUTLIER_SCALE)."""
    gen = torch.Generator().manual_seed(seed)
    out, n = shape
    z = torch.randn(out, n, generator=gen, dtype=torch.float64)
    if kind == "gaussian":
        return (z / n ** 0.5).float()
    if kind != "heavy":
        raise ValueError(f"unknown matrix kind {kind!r}")
    dof = 4
    chi2 = torch.randn(out, n, dof, generator=gen, dtype=torch.float64).pow(2).sum(-1)
    t = z / (chi2 / dof).sqrt()
    cols = torch.randperm(n, generator=gen)[:OUTLIER_COLUMNS]
    t[:, cols] *= OUTLIER_SCALE
    return (t / n ** 0.5).float()


def settings() -> list[Setting]:
    """tq's default (Lloyd-Max, group 128, outliers) per rotation and bit width, and plain
    symmetric round-to-nearest as the floor to beat."""
    rows = []
    for bits in BITS:
        rows.append(Setting("rtn", QuantSpec(bits=bits, codebook="uniform", scale_iters=0,
                                             outliers=0.0), "none"))
        for rot in ROTATIONS:
            rows.append(Setting("tq", QuantSpec(bits=bits), rot))
    return rows


def run(device: torch.device, progress: Callable[[str], None] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Metric]]:
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Metric] = {}
    for kind in ("gaussian", "heavy"):
        w = matrix(kind)
        for s in settings():
            if progress:
                progress(f"quality {kind} {s.label} {s.quant.bits}-bit {s.rotation}")
            rot = make_rotation(RotationSpec(kind=s.rotation), w.shape[1], s.quant.group_size)
            q = quantize(w, s.quant, rot, device=device)
            nbits = 8 * (q.nbytes() + sum(t.numel() * t.element_size()
                                          for t in rot.tensors().values()))
            bpw = nbits / w.numel()
            name = f"quality.{kind}.{s.label}.{s.rotation}.{s.quant.bits}bit"
            rows.append({"matrix": kind, "method": s.label, "rotation": s.rotation,
                         "bits": s.quant.bits, "group_size": s.quant.group_size,
                         "rel_error": q.rel_error, "bits_per_weight": bpw})
            metrics[f"{name}.rel_error"] = Metric(q.rel_error, "quality")
            metrics[f"{name}.bpw"] = Metric(bpw, "quality")
    return rows, metrics

"""Column (input-channel) scales before the rotation: SINQ's Sinkhorn normalisation.

SINQ (Sinkhorn-Normalized Quantization, Müller et al. 2025, arXiv:2509.22944) scales a
weight's rows and columns before the grid, found by alternately dividing rows and columns
by their standard deviation, so that no row or column dominates. In tq every row already
has its own group scales, so a row scale changes nothing; what SINQ adds is the column
scale t:

    W = W' diag(t),   W' rotated and quantized as usual,   y = ((x * t) R) W'_rot^T

so a converted weight stores t (fp16, one per input column) and every kernel path scales
x by t before rotating it. A calibrated fit sees the scaled input x' = x t, whose
second moment is H' = diag(t) H diag(t); the Hessian-weighted error tr(dW' H' dW'^T)
equals tr(dW H dW^T), so GPTQ minimises the same quantity as without t.

Measured in docs/results.md (column scales): it helps both test models, weight-only and
self-calibrated, so `tq convert` uses it by default (`--col-scale none` turns it off).
"""

from __future__ import annotations

import torch

from tq_cli.quant.rotation import Rotation

SINKHORN_ITERS = 16
# t is stored as fp16: kept inside the range where fp16 is exact to 1 part in 2^11.
T_MIN, T_MAX = 2.0**-14, 2.0**15
_W_PEAK = 2.0**13  # the largest |W'| allowed, well inside fp16 scales' range


MIN_ROWS = 16  # fewer rows: no column scales (t = 1)


def sinkhorn_columns(w: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """SINQ's dual normalisation of `w` [out, in]; returns the column scales t [in]
    (float32 holding fp16 values, positive), rows being tq's group scales' job.

    Alternately divide rows, then columns, by their standard deviation, keeping the iterate
    whose imbalance (largest over smallest std, rows and columns) is the lowest, as SINQ
    does. The normalised matrix is never formed: with x = diag(1/r) W diag(1/c), the
    std of row i is that of W_ij / c_j over j, over r_i, from the sums W (1/c) and
    W^2 (1/c^2), and likewise for columns; so each step is matrix-vector products with W
    and W^2 (one float32 copy of w besides w itself)."""
    if w.dim() != 2:
        raise ValueError(f"column scales need a 2-D weight, got shape {tuple(w.shape)}")
    out, n = w.shape
    a = w.detach().to(torch.float32)
    ones = torch.ones(n, dtype=torch.float32)
    if out < MIN_ROWS or n < 2 or not bool(a.abs().amax() > 0):
        # no spread to normalise (all zeros, one column), or too few rows for a column's
        # std to mean anything: a 2 x 12 weight at 2 bits went from 0.04 to 0.69 relative
        # error with scales from two values per column (Hypothesis found it)
        return ones
    a2 = a * a

    def row_std(c: torch.Tensor) -> torch.Tensor:  # std over j of W_ij / c_j
        inv = (1.0 / c).float()
        m1 = (a @ inv).double() / n
        m2 = (a2 @ (inv * inv)).double() / n
        return (m2 - m1 * m1).clamp_min(0).sqrt()

    def col_std(r: torch.Tensor) -> torch.Tensor:  # std over i of W_ij / r_i
        inv = (1.0 / r).float()
        m1 = (inv @ a).double() / out
        m2 = ((inv * inv) @ a2).double() / out
        return (m2 - m1 * m1).clamp_min(0).sqrt()

    def floored(x: torch.Tensor) -> torch.Tensor:
        # A zero row or column (std 0) is floored a million times below the largest, so
        # 1/c stays finite in float32 through the next products.
        return x.clamp_min(max(float(x.max()) * 1e-6, 1e-30))

    c = torch.ones(n, dtype=torch.float64, device=w.device)
    best, best_c = float("inf"), c.clone()
    rs = row_std(c)
    for _ in range(iters):
        r = floored(rs)  # x's rows have std rs / r = 1 after this division
        c = floored(col_std(r))
        rs = row_std(c)  # rows of the new x, times r: its row stds are rs / r
        # the new x's columns have std 1 (0 for a zero column): the imbalance is over its
        # rows and 1
        x_rows = rs / r
        imbalance = float(torch.maximum(x_rows.max(), torch.ones((), dtype=torch.float64))
                          / torch.minimum(x_rows.min(), torch.ones((), dtype=torch.float64))
                          .clamp_min(1e-30))
        if imbalance < best:
            converged = imbalance > best * (1 - 1e-4)
            best, best_c = imbalance, c.clone()
            if converged:  # on SmolLM2's layers t no longer moves after 5-6 steps
                break
    if not bool(torch.isfinite(best_c).all()):
        return ones
    # Centred on 1 (the geometric mean), so W' keeps W's magnitude; no column of W' may
    # pass what fp16 group scales hold (a lone large entry in a quiet column); fp16-exact.
    t = (best_c.log() - best_c.log().mean()).exp().float()
    peak = a.abs().amax(dim=0) / _W_PEAK
    return torch.maximum(t, peak).clamp(T_MIN, T_MAX).half().float().cpu()


def scale_hessian(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """H' = diag(t) H diag(t): the second moment of the scaled input x t."""
    td = t.to(h.device, h.dtype)
    return h * td[:, None] * td[None, :]


def scale_hessian_(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`scale_hessian` in place, on an H the caller owns (no second n x n matrix)."""
    td = t.to(h.device, h.dtype)
    return h.mul_(td[:, None]).mul_(td[None, :])


def true_sq(x_rot: torch.Tensor, t: torch.Tensor, rotation: Rotation,
            chunk_elements: int = 1 << 21) -> float:
    """||unrotate(x_rot) diag(t)||^2 in float64, a block of rows at a time: a scaled
    weight's (or its error's) squared norm in the original basis."""
    tt = t.to(x_rot.device, torch.float32)
    rows = max(1, chunk_elements // max(1, x_rot.shape[1]))
    total = 0.0
    for r in range(0, x_rot.shape[0], rows):
        part = rotation.unrotate(x_rot[r:r + rows].float()) * tt
        total += float(part.double().pow(2).sum())
    return total

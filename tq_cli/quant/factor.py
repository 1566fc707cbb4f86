"""The Hessian as GPTQ needs it (`tq_cli.quant.gptq`): rotated into the weights' basis,
checked, symmetrised, and the upper Cholesky factor of its damped inverse, all in the
one copy the fit owns where it can (at n = 14336 each n x n matrix is 0.8 GB in
float32; docs/decisions.md, "The calibrated fit at 8B sizes"). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tq_cli.errors import TqError
from tq_cli.quant.rotation import Rotation

DAMP_RETRIES = 4  # damping x10 per retry before a Hessian is declared unusable


class CalibrationUnusableError(TqError):
    """A layer's calibration Hessian cannot be used; the caller falls back to data-free."""


def rotate_hessian(h: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """R^T H R in float64 for the rotation the weights use (w_rot = w @ R, x_rot = x @ R).

    Since x_rot x_rot^T summed is R^T (sum x x^T) R, tr(dW H dW^T) is the same in either
    basis. `rotation.rotate` is dtype-generic, so the float64 input stays float64.
    """
    _check_square(h, rotation.n)
    return rotate_hessian_(h.to(torch.float64).clone(), rotation)


def _check_square(h: torch.Tensor, n: int) -> None:
    if h.dim() != 2 or h.shape[0] != h.shape[1] or h.shape[0] != n:
        raise ValueError(f"Hessian of shape {tuple(h.shape)} does not fit a rotation of "
                         f"{n} columns")


def rotate_hessian_(h: torch.Tensor, rotation: Rotation,
                    chunk_elements: int = 1 << 22) -> torch.Tensor:
    """`rotate_hessian` in place on an H the caller owns, in its dtype: H R a block of rows
    at a time, then R^T (H R) a block of columns at a time (each column is rotated on its
    own), so no second n x n matrix is ever alive (a 14336-wide float32 H is 0.8 GB)."""
    _check_square(h, rotation.n)
    if rotation.kind == "none":
        return h
    n = h.shape[0]
    width = max(1, chunk_elements // max(1, n))
    for r in range(0, n, width):
        h[r:r + width] = rotation.rotate(h[r:r + width])
    for c in range(0, n, width):
        h[:, c:c + width] = rotation.rotate(h[:, c:c + width].T).T
    return h


def _checked_hessian(h_rot: torch.Tensor, n: int, dev: torch.device,
                     owned: bool = False) -> torch.Tensor:
    """Symmetrised H (float32 stays float32, anything else becomes float64) with dead
    columns set to 1 on the diagonal, or an error; in place where the caller `owned` it."""
    if h_rot.shape != (n, n):
        raise ValueError(f"Hessian has shape {tuple(h_rot.shape)}, the weight needs ({n}, {n})")
    dtype = h_rot.dtype if h_rot.dtype == torch.float32 else torch.float64
    h = h_rot.to(dev, dtype)
    if not owned and h is h_rot:
        h = h.clone()
    bad = _nonfinite(h)
    if bad:
        raise CalibrationUnusableError(f"the calibration Hessian has {bad} non-finite entries")
    _symmetrise_(h)
    diag = torch.diagonal(h)
    if not bool((diag > 0).any()):
        raise CalibrationUnusableError(
            "the calibration Hessian is all zeros (the layer saw no calibration tokens)")
    if bool((diag < 0).any()):
        raise CalibrationUnusableError(
            "the calibration Hessian has negative diagonal entries (not a sum of x x^T)")
    # A column no token ever touched: its row and column of H are zero; as in the GPTQ
    # reference, give it unit weight so it is quantized to nearest and the factor exists.
    # Its weights are kept (the reference zeroes them) so the checkpoint stays faithful.
    dead = diag == 0
    h[dead, dead] = 1.0
    return h


def _nonfinite(t: torch.Tensor, chunk_elements: int = 1 << 22) -> int:
    """NaN and Inf entries of t, counted a block of rows at a time: isfinite of a whole
    matrix makes |t| and two masks beside it (1.5 copies of a 14336-wide H)."""
    rows = max(1, chunk_elements // max(1, t.shape[-1]))
    return sum(int((~torch.isfinite(t[r:r + rows])).sum()) for r in range(0, t.shape[0], rows))


def _symmetrise_(h: torch.Tensor, block: int = 1024) -> None:
    """(H + H^T) / 2 in place, a pair of blocks at a time."""
    n = h.shape[0]
    for i in range(0, n, block):
        for j in range(i, n, block):
            a, b = h[i:i + block, j:j + block], h[j:j + block, i:i + block]
            m = (a + b.T) / 2
            a.copy_(m)
            b.copy_(m.T)


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) I)^-1 (U^T U = that inverse),
    float32 (GPTQ sec. 3.3), raising the damping x10 a few times before giving up; in H's
    precision, H left as it came.

    Computed as U = J L^-1 J with J H J = L L^T (J reverses the order): then U^T U =
    J (J H J)^-1 J = H^-1 and U is upper triangular with a positive diagonal, so it is that
    factor, for one Cholesky and one triangular inverse (n^3 / 3 each) instead of a
    Cholesky, an inverse and a second Cholesky (4 n^3 / 3). L is factored and inverted in
    place in the one copy J H J, so one n x n matrix beside H at a time."""
    n = h.shape[0]
    mean_diag = float(torch.diagonal(h).mean(dtype=torch.float64))
    frac = damp
    info = torch.zeros((), dtype=torch.int32, device=h.device)
    for attempt in range(DAMP_RETRIES):
        if attempt:
            frac = max(frac, 1e-6) * 10
        low = h.flip(0, 1)
        torch.diagonal(low).add_(frac * mean_diag)
        # LAPACK's potrf works on a column-major matrix: handed low itself (row-major),
        # torch factors a column-major copy and copies it back (a second n x n at the
        # conversion's peak); handed low.T, symmetric and column-major, it factors in
        # place, leaving L^T in low's storage, transposed back in place.
        low_t = low.T
        torch.linalg.cholesky_ex(low_t, out=(low_t, info))
        del low_t
        _transpose_(low)
        if int(info) != 0:
            del low
            continue
        _invert_lower_(low)
        up = _reverse_(low.float())  # J L^-1 J in place: no third n x n
        del low
        if _nonfinite(up) == 0 and bool((torch.diagonal(up) > 0).all()):
            return up
    raise CalibrationUnusableError(
        f"the calibration Hessian [{n}x{n}] is not positive definite "
        f"even with damping {frac:g} x its mean diagonal (Cholesky failed)")


def _transpose_(t: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """t.T in place for a contiguous square matrix, a pair of blocks at a time."""
    n = t.shape[0]
    for i in range(0, n, block):
        d = t[i:i + block, i:i + block]
        d.copy_(d.T.clone())
        for j in range(i + block, n, block):
            a, b = t[i:i + block, j:j + block], t[j:j + block, i:i + block]
            keep = a.clone()
            a.copy_(b.T)
            b.copy_(keep.T)
    return t


def _reverse_(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """t.flip(0, 1) in place for a contiguous matrix (its flat elements reversed), with
    buffers of `chunk` elements: flip copies, and for a 14336-wide factor a copy is 0.8 GB
    at the conversion's peak."""
    flat = t.view(-1)
    n = flat.numel()
    i = 0
    while i < n // 2:
        c = min(chunk, n // 2 - i)
        front = flat[i:i + c].clone()
        flat[i:i + c] = flat[n - i - c:n - i].flip(0)
        flat[n - i - c:n - i] = front.flip(0)
        i += c
    return t


def _invert_lower_(low: torch.Tensor, leaf: int = 512) -> None:
    """L^-1 in place for a lower-triangular L: [[A, 0], [C, B]]^-1 = [[A^-1, 0],
    [-B^-1 C A^-1, B^-1]], halves inverted in place and C by two products (about n^3 / 3
    multiply-adds in GEMMs, where a triangular solve against I costs n^3 / 2 and a second
    n x n matrix)."""
    n = low.shape[0]
    if n <= leaf:
        eye = torch.eye(n, dtype=low.dtype, device=low.device)
        low.copy_(torch.linalg.solve_triangular(low, eye, upper=False))
        return
    k = n // 2
    a, b, c = low[:k, :k], low[k:, k:], low[k:, :k]
    _invert_lower_(a, leaf)
    _invert_lower_(b, leaf)
    torch.matmul(b, c @ a, out=c)  # into C's own rows: one (n/2)^2 temporary, not two
    c.neg_()


@dataclass
class PreparedHessian:
    """What GPTQ needs of a rotated Hessian, computed once for the layers that read the
    same input (q, k, v; gate, up): H checked and symmetrised (float64), the column order,
    and the upper Cholesky factor of the damped inverse in that order (float32).
    `owned`: one fit uses it and may drop the factor once its GPTQ passes are done."""

    h: torch.Tensor
    order: torch.Tensor
    up: torch.Tensor
    owned: bool = False

    def release_factor(self) -> None:
        """Drop the inverse factor (its fit is past the GPTQ passes); only for `owned`."""
        self.up = torch.empty(0, device=self.h.device)


def prepare_hessian(h_rot: torch.Tensor, *, damp: float = 0.01, act_order: bool = False,
                    device: torch.device | str | None = None,
                    owned: bool = False) -> PreparedHessian:
    """`quantize_calibrated`'s preparation of H; raises `CalibrationUnusableError`.
    `owned`: h_rot is the caller's own copy (float32 stays float32, as `_checked_hessian`
    says), checked and symmetrised in place and kept as the result's `h` instead of
    copied."""
    dev = torch.device(device) if device is not None else h_rot.device
    n = h_rot.shape[0]
    h = _checked_hessian(h_rot, n, dev, owned)
    if act_order:
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        return PreparedHessian(h, order, _inverse_cholesky(h[order][:, order], damp))
    return PreparedHessian(h, torch.arange(n, device=dev), _inverse_cholesky(h, damp))

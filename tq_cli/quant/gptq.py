"""Calibrated (GPTQ-style) quantization of a weight in the rotated space.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", arXiv:2210.17323) quantizes one input column at a time and
feeds each column's error forward onto the columns not yet quantized, through the upper
Cholesky factor of the inverse Hessian, so that the output error tr(dW H dW^T) stays
small rather than the plain weight error. Here it runs on the tq grid: the per-group fp16
scales and the per-tensor codebook of the data-free fit (`tq_cli.quant.grouped.fit_grid`),
with codes by nearest level on the error-fed weights.

Data comes in as a rotated weight w_rot = W @ R [out, in] and the Hessian H = sum x x^T
(from calibration, see `rotate_hessian` for its rotation) and leaves as a
`QuantizedTensor` in exactly the data-free format. Pure: no I/O, no printing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tq_cli.quant.factor import (
    CalibrationUnusableError,
    PreparedHessian,
    prepare_hessian,
    rotate_hessian,
    rotate_hessian_,
)
from tq_cli.quant.grouped import (
    CHUNK_ELEMENTS,
    FP16_MAX,
    QuantizedTensor,
    fit_grid,
    native_available,
    outlier_count,
    sq_norm,
)
from tq_cli.quant.rotation import Rotation
from tq_cli.quant.spec import QuantSpec
from tq_kernels.packing import pack_codes


@dataclass
class _Solved:
    """One GPTQ pass, in the original column order: the codes and W_hat, or for a first
    pass only where its largest losses are."""

    codes: torch.Tensor | None  # uint8 [out, n]
    w_hat: torch.Tensor | None  # float32 [out, n], outliers included
    top: torch.Tensor | None = None  # sorted flat idx into [out, n] of the top_k losses


def _solve(w: torch.Tensor, up: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
           group_size: int, order: torch.Tensor, outliers: torch.Tensor, block_size: int,
           top_k: int = 0, native: bool | None = None) -> _Solved:
    """One GPTQ pass over the columns in `order` (GPTQ Algorithm 1, lazy batch updates).
    With `top_k` > 0 it is the first pass, which keeps only the positions of the top_k
    largest GPTQ losses err^2 / d_jj^2 (merged block by block: no [out, n] loss matrix,
    and with the native loop no codes or W_hat either).

    Works on W^T so a column is a contiguous row; every step is vectorised over the
    weight's rows. At `outliers` (flat idx into [out, n]) the dequantized value is the
    error-fed weight itself (code plus its fp16 residual), so they feed on almost no error.
    On the CPU each block's column loop is one native call (tq_kernels.fit.gptq_block_,
    the same steps; `native=False`, or TQ_FIT=torch, runs the torch loop, the reference
    it is tested against); the update of the later blocks is torch's GEMM either way.
    """
    if native is None:
        native = w.device.type == "cpu" and native_available()
    out, n = w.shape
    dev = w.device
    wt = w[:, order].T.contiguous()  # [n, out], error-fed in place
    st = scales.T.contiguous().float()
    codebook = codebook.contiguous().float()
    st_safe = torch.where(st > 0, st, torch.ones_like(st))
    gcol = (order // group_size).tolist()
    mids = (codebook[1:] + codebook[:-1]) / 2
    diag = torch.diagonal(up).tolist()
    scratch = top_k > 0 and native  # the first pass keeps no codes: one block's buffers
    rows_t = block_size if scratch else n
    codes_t = torch.empty(rows_t, out, dtype=torch.uint8, device=dev)
    qt = torch.empty(rows_t, out, dtype=torch.float32, device=dev)
    top_v = torch.empty(0, dtype=torch.float32, device=dev)
    top_i = torch.empty(0, dtype=torch.long, device=dev)
    # The outliers' rows, by the processing position of their column.
    per_col: dict[int, torch.Tensor] = {}
    if outliers.numel():
        inv = torch.empty_like(order)
        inv[order] = torch.arange(n, device=dev)
        pos = inv[outliers % n]
        slots = torch.argsort(pos, stable=True)
        uniq, counts = torch.unique_consecutive(pos[slots], return_counts=True)
        for p, sl in zip(uniq.tolist(), torch.split(slots, counts.tolist()), strict=True):
            per_col[p] = outliers[sl] // n
    mask = None
    if native and per_col:
        mask = torch.zeros(n, out, dtype=torch.uint8)
        for p, rows_p in per_col.items():
            mask[p, rows_p] = 1
    gall = torch.as_tensor(gcol, dtype=torch.long)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = wt[i1:i2]
        u1 = up[i1:i2, i1:i2]
        e1 = torch.empty(i2 - i1, out, dtype=torch.float32, device=dev)
        if native:
            from tq_kernels import fit

            rows = slice(0, i2 - i1) if scratch else slice(i1, i2)
            fit.gptq_block_(w1, u1.contiguous(), st, gall[i1:i2], codebook,
                            None if mask is None else mask[i1:i2], codes_t[rows],
                            qt[rows], e1)
        else:
            _block_loop(w1, u1, e1, i1, st, st_safe, gcol, mids, codebook, per_col, diag,
                        codes_t, qt)
        if top_k:
            top_v, top_i = _merge_top(top_v, top_i, (e1 * e1).reshape(-1), i1 * out, top_k)
        if i2 < n:
            wt[i2:].addmm_(up[i1:i2, i2:].T, e1, alpha=-1)
    del wt
    if top_k:
        cols = order[top_i // out]
        return _Solved(None, None, torch.sort((top_i % out) * n + cols).values)
    if torch.equal(order, torch.arange(n, device=dev)):  # no reordering: views, no copies
        return _Solved(codes_t.T, qt.T)
    codes = torch.empty(out, n, dtype=torch.uint8, device=dev)
    codes[:, order] = codes_t.T
    w_hat = torch.empty(out, n, dtype=torch.float32, device=dev)
    w_hat[:, order] = qt.T
    return _Solved(codes, w_hat)


def _block_loop(w1: torch.Tensor, u1: torch.Tensor, e1: torch.Tensor, i1: int,
                st: torch.Tensor, st_safe: torch.Tensor, gcol: list[int], mids: torch.Tensor,
                codebook: torch.Tensor, per_col: dict[int, torch.Tensor], diag: list[float],
                codes_t: torch.Tensor, qt: torch.Tensor) -> None:
    """The torch column loop of one block (the reference of the native gptq_block_)."""
    b = w1.shape[0]
    for i in range(b):
        j = i1 + i
        x = w1[i]
        g = gcol[j]
        c = torch.bucketize(x / st_safe[g], mids)  # `nearest`, midpoints hoisted
        q = codebook[c] * st[g]
        rows = per_col.get(j)
        if rows is not None:
            q[rows] += (x[rows] - q[rows]).half().float()
        codes_t[j] = c
        qt[j] = q
        torch.sub(x, q, out=e1[i]).div_(diag[j])
        if i + 1 < b:
            w1[i + 1:].addr_(u1[i, i + 1:], e1[i], alpha=-1)


def _merge_top(vals: torch.Tensor, idx: torch.Tensor, block: torch.Tensor, offset: int,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of (vals at idx) and (block at offset + its positions): the top k of
    a union is the top k of the parts' top k, so a pass keeps k entries, not [n, out]."""
    if block.numel() > k:
        part = torch.topk(block, k)
        bv, bi = part.values, part.indices + offset
    else:
        bv = block
        bi = torch.arange(offset, offset + block.numel(), device=block.device)
    v, i = torch.cat([vals, bv]), torch.cat([idx, bi])
    if v.numel() > k:
        keep = torch.topk(v, k).indices
        v, i = v[keep], i[keep]
    return v, i


def _group_sum(x: torch.Tensor, g: int, groups: int) -> torch.Tensor:
    """Sum of the last dimension over consecutive groups of g, zero-padded to groups * g."""
    x = torch.nn.functional.pad(x, (0, groups * g - x.shape[-1]))
    return x.view(*x.shape[:-1], groups, g).sum(-1)


def _sparse_rows(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, r: int,
                 n: int) -> torch.Tensor:
    """An [r, n] sparse matrix (COO) with vals at (rows, cols), sorted row-major."""
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (r, n),
                                   is_coalesced=True, check_invariants=False)


def _refit_scales(w: torch.Tensor, res: _Solved, scales: torch.Tensor,
                  codebook: torch.Tensor, h: torch.Tensor, outliers: torch.Tensor,
                  g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Group scales minimising tr(dW H dW^T) for the fixed codes, per row (scales, w_hat,
    outlier_val), and the weighted error of the result with its reference:
    ((dW H dW^T)_ii per row, float64, and tr(W H W^T)). Outliers keep their dequantized
    value. A row keeps its old scales unless the new (fp16-rounded) ones lower its weighted error.

    W_hat_r = A_r s_r + f_r with A_r[j, group(j)] = c[code_rj] is linear in the row's
    scales s_r. With d the GPTQ result's error w - W_hat and p = H d (the one n x n product
    per row), the step delta solves (A^T H A) delta = A^T p, a groups x groups system
    solved in float64, and changes the error by delta^T (A^T H A) delta - 2 delta^T A^T p.
    Both errors, and tr(W H W^T) = (d + W_hat) H (d + W_hat)^T, follow from p, A^T H A and
    the outliers' sparse H f without a second product: taken from the error itself, not by
    expanding W H W^T - 2 ..., which would cancel to nothing at 8 bits.
    """
    out, n = w.shape
    groups = scales.shape[1]
    assert res.codes is not None and res.w_hat is not None, "a first pass has no codes"
    codes, fed = res.codes, res.w_hat
    dt = h.dtype
    hit = torch.zeros(out * n, dtype=torch.bool, device=w.device)
    hit[outliers] = True
    hit = hit.view(out, n)
    new = scales.clone()
    vals = torch.empty(outliers.numel(), dtype=torch.float16, device=w.device)
    w_hat_all = torch.empty(out, n, dtype=torch.float32, device=w.device)
    o_rows, o_cols = outliers // n, outliers % n
    rows = max(1, CHUNK_ELEMENTS // (groups * g))
    cbh = codebook.to(dt)
    num = torch.empty(out, dtype=torch.float64, device=w.device)
    den = 0.0
    for r0 in range(0, out, rows):
        r1 = min(r0 + rows, out)
        a = torch.where(hit[r0:r1], 0.0, cbh[codes[r0:r1].long()])
        d = (w[r0:r1] - fed[r0:r1]).to(dt)
        p = d @ h  # H d, H symmetric
        err = (d * p).sum(-1, dtype=torch.float64)  # d H d per row
        grad = _group_sum(a * p, g, groups).double()  # A^T H d
        cross = (fed[r0:r1].to(dt) * p).sum(-1, dtype=torch.float64)  # W_hat H d
        del p
        m = torch.empty(r1 - r0, groups, groups, dtype=torch.float64, device=w.device)
        for gi in range(groups):
            c0, c1 = gi * g, min(gi * g + g, n)
            blk = _group_sum((a[:, c0:c1] @ h[c0:c1, c0:]) * a[:, c0:], g, groups - gi)
            m[:, gi, gi:] = blk
            m[:, gi + 1:, gi] = blk[:, 1:]
        s_old = scales[r0:r1].double()
        # W_hat H W_hat = s^T (A^T H A) s + 2 s^T A^T H f + f H f, f the outliers' values.
        fit = (s_old * (m @ s_old[..., None])[..., 0]).sum(-1)
        sel = (o_rows >= r0) & (o_rows < r1)
        orow, ocol = o_rows[sel] - r0, o_cols[sel]
        f = fed[r0:r1][orow, ocol]
        if orow.numel():
            hf = _sparse_rows(orow, ocol, f.to(dt), r1 - r0, n) @ h
            fit += 2 * (s_old * _group_sum(a * hf, g, groups).double()).sum(-1)
            fit += torch.zeros(r1 - r0, dtype=torch.float64, device=w.device).index_add_(
                0, orow, (f.to(dt) * hf[orow, ocol]).double())
            del hf
        den += float((err + 2 * cross + fit).sum())
        # A group with no coded entry (all outliers) has a zero row: its scale stays.
        empty = torch.diagonal(m, dim1=1, dim2=2) <= 0
        ridge = 1e-12 * torch.diagonal(m, dim1=1, dim2=2).mean(-1).clamp(min=1e-300)
        lhs = m + torch.diag_embed(empty.double() + ridge[:, None])
        step, info = torch.linalg.solve_ex(lhs, torch.where(empty, 0.0, grad))
        s_new = (s_old + step).clamp(-FP16_MAX, FP16_MAX).half().double()
        delta = s_new - s_old
        gain = (delta * (m @ delta[..., None])[..., 0]).sum(-1) - 2 * (delta * grad).sum(-1)
        ok = (info == 0) & torch.isfinite(s_new).all(-1) & (gain < 0)
        new[r0:r1] = torch.where(ok[:, None], s_new.float(), scales[r0:r1])
        err += torch.where(ok, gain, 0.0)
        # The stored W_hat of these rows, exactly as `dequantize_rotated` computes it.
        w_hat = codebook[codes[r0:r1].long()] * new[r0:r1].repeat_interleave(g, 1)[:, :n]
        v = (f - w_hat[orow, ocol]).half()
        vals[sel.nonzero()[:, 0]] = v
        w_hat[orow, ocol] += v.float()
        w_hat_all[r0:r1] = w_hat
        if orow.numel():  # the outliers' values moved by their fp16 rounding: e -> e - df
            df = (w_hat[orow, ocol] - f).to(dt)
            hdf = _sparse_rows(orow, ocol, df, r1 - r0, n) @ h
            e_mid = w[r0:r1].to(dt) - w_hat.to(dt)
            e_mid[orow, ocol] += df  # the error before the outliers' rounding moved
            err += torch.zeros_like(err).index_add_(0, orow, (df * hdf[orow, ocol]).double())
            err -= 2 * (hdf * e_mid).sum(-1, dtype=torch.float64)
            del hdf, e_mid
        num[r0:r1] = err.clamp(min=0.0)
    return new, w_hat_all, vals, num, den


@dataclass(frozen=True)
class CalibratedFit:
    """`fit_calibrated`'s result: the tensor, and its weighted error tr(dW H dW^T) alone and
    over tr(W H W^T) (what `weighted_errors` would compute, without its two passes)."""

    q: QuantizedTensor
    weighted_error: float
    relative_weighted_error: float
    row_errors: torch.Tensor  # (dW H dW^T)_ii per output row, float64, on the CPU


def quantize_calibrated(w_rot: torch.Tensor, h_rot: torch.Tensor | PreparedHessian,
                        spec: QuantSpec, rotation: Rotation, *, damp: float = 0.01,
                        act_order: bool = False, block_size: int = 128,
                        device: torch.device | str | None = None) -> QuantizedTensor:
    """`fit_calibrated`'s tensor alone."""
    return fit_calibrated(w_rot, h_rot, spec, rotation, damp=damp, act_order=act_order,
                          block_size=block_size, device=device).q


def fit_calibrated(w_rot: torch.Tensor, h_rot: torch.Tensor | PreparedHessian,
                   spec: QuantSpec, rotation: Rotation, *, damp: float = 0.01,
                   act_order: bool = False, block_size: int = 128,
                   device: torch.device | str | None = None) -> CalibratedFit:
    """GPTQ (arXiv:2210.17323) of a rotated weight [out, in] on the tq grid, given the
    rotated Hessian [in, in] (`rotate_hessian`). Same format as `quantize_rotated`.

    `damp` is the fraction of mean(diag H) added to the diagonal (raised x10 up to three
    times if Cholesky fails); `act_order` processes columns by decreasing diag(H) with
    the static group scales, so the stored format is unchanged. Exactly
    `outlier_count(out * in, spec.outliers)` outliers are kept: the entries of largest
    GPTQ loss err^2 / d_jj^2 in a first pass, stored so that the dequantized value is the
    error-fed weight there (they pass on only fp16 rounding error). Finally each row's
    group scales are refit by Hessian-weighted least squares for the chosen codes (about
    1-2% less weighted error on SmolLM2 layers, calibration and held-out text alike).
    Raises `CalibrationUnusableError` when H is zero, non-finite or not factorisable.
    """
    if w_rot.dim() != 2:
        raise ValueError(f"quantize_calibrated needs a 2-D weight, got {tuple(w_rot.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    dev = torch.device(device) if device is not None else w_rot.device
    out, n = w_rot.shape
    if (h_rot.h if isinstance(h_rot, PreparedHessian) else h_rot).shape != (n, n):
        shape = tuple((h_rot.h if isinstance(h_rot, PreparedHessian) else h_rot).shape)
        raise ValueError(f"Hessian has shape {shape}, the weight needs ({n}, {n})")
    if isinstance(h_rot, PreparedHessian):
        prepared = h_rot
    else:
        prepared = prepare_hessian(h_rot, damp=damp, act_order=act_order, device=dev)
    h, order, up = prepared.h, prepared.order, prepared.up
    w = w_rot.to(dev, torch.float32)
    scales, codebook = fit_grid(w, spec, dev)
    k = outlier_count(out * n, spec.outliers)
    outliers = torch.empty(0, dtype=torch.long, device=dev)
    if k:
        first = _solve(w, up, scales, codebook, spec.group_size, order, outliers,
                       block_size, top_k=k)
        assert first.top is not None
        outliers = first.top
    res = _solve(w, up, scales, codebook, spec.group_size, order, outliers, block_size)
    assert res.codes is not None
    codes = res.codes
    del up
    if isinstance(h_rot, PreparedHessian) and h_rot.owned:
        h_rot.release_factor()  # the refit needs H alone (0.8 GB less at n = 14336)
    elif not isinstance(h_rot, PreparedHessian):
        prepared.release_factor()
    scales, w_hat, vals, row_err, den = _refit_scales(w, res, scales, codebook, h, outliers,
                                                  spec.group_size)
    del res  # its W_hat, before the refit's own
    rows = max(1, CHUNK_ELEMENTS // max(1, n))  # no third [out, n] for the difference
    err = sum(float(torch.linalg.vector_norm(w[r:r + rows] - w_hat[r:r + rows],
                                             dtype=torch.float64)) ** 2
              for r in range(0, out, rows))
    norm = sq_norm(w)
    del w_hat
    q = QuantizedTensor(
        shape=(out, n), spec=spec, rotation=rotation,
        codes=pack_codes(codes, spec.bits).cpu(),
        scales=scales.half().cpu(), codebook=codebook.float().cpu(),
        outlier_idx=outliers.to(torch.int32).cpu(), outlier_val=vals.cpu(),
        rel_error=err / norm if norm > 0 else 0.0,
    )
    num = float(row_err.sum())
    return CalibratedFit(q, num, num / den if den > 0 else 0.0 if num == 0 else float("inf"),
                         row_err.cpu())


def _weighted(w_rot: torch.Tensor, w_hat_rot: torch.Tensor,
              h_rot: torch.Tensor) -> tuple[float, float]:
    """(tr(dW H dW^T), tr(W H W^T)) in float64, a chunk of rows at a time."""
    if w_rot.shape != w_hat_rot.shape or h_rot.shape != (w_rot.shape[1], w_rot.shape[1]):
        raise ValueError(f"shapes do not fit: W {tuple(w_rot.shape)}, W_hat "
                         f"{tuple(w_hat_rot.shape)}, H {tuple(h_rot.shape)}")
    h = h_rot.to(torch.float64)
    rows = max(1, CHUNK_ELEMENTS // max(1, w_rot.shape[1]))
    num = den = 0.0
    for r in range(0, w_rot.shape[0], rows):
        x = w_rot[r:r + rows].to(h.device, torch.float64)
        d = x - w_hat_rot[r:r + rows].to(h.device, torch.float64)
        num += float(((d @ h) * d).sum())
        den += float(((x @ h) * x).sum())
    return num, den


def weighted_errors(w_rot: torch.Tensor, w_hat_rot: torch.Tensor,
                    h_rot: torch.Tensor) -> tuple[float, float]:
    """(tr(dW H dW^T), that over tr(W H W^T)) in one pass: `weighted_error` and
    `relative_weighted_error` together."""
    num, den = _weighted(w_rot, w_hat_rot, h_rot)
    return num, (num / den if den > 0 else 0.0 if num == 0 else float("inf"))


def weighted_error(w_rot: torch.Tensor, w_hat_rot: torch.Tensor, h_rot: torch.Tensor) -> float:
    """tr(dW H dW^T) with dW = W - W_hat: the summed squared output error over the
    calibration tokens (the same in the rotated and the original basis)."""
    return _weighted(w_rot, w_hat_rot, h_rot)[0]


def relative_weighted_error(w_rot: torch.Tensor, w_hat_rot: torch.Tensor,
                            h_rot: torch.Tensor) -> float:
    """tr(dW H dW^T) / tr(W H W^T); 0 when both are 0, inf when only W's term is."""
    num, den = _weighted(w_rot, w_hat_rot, h_rot)
    if den > 0:
        return num / den
    return 0.0 if num == 0 else float("inf")


__all__ = ["CalibratedFit", "CalibrationUnusableError", "PreparedHessian", "fit_calibrated",
           "prepare_hessian", "quantize_calibrated", "relative_weighted_error",
           "rotate_hessian", "rotate_hessian_", "weighted_error", "weighted_errors"]

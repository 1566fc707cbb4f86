"""Grouped codebook quantization of a weight matrix in the rotated space (docs/design.md, math 2-5).

Data comes in as a float weight [out, in] (or already rotated, from the streaming
pipeline) and leaves as a `QuantizedTensor` of packed codes, fp16 group scales, a
per-tensor codebook and a sparse list of exactly kept outliers. Pure: no I/O, no printing.

The fit alternates three exact minimisations of sum (x - s_g c[code])^2, so the error
never rises between passes: nearest-level assignment given scales and codebook; each
group's least-squares scale given its codes; each level's weighted mean (1-D k-means,
the articles' "codebook generated from the distribution") given codes and scales.
Work runs over row chunks so memory stays a small multiple of the weight itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tq_cli.quant.codebook import initial_codebook, nearest
from tq_cli.quant.colscale import true_sq
from tq_cli.quant.rotation import Rotation
from tq_cli.quant.spec import QuantSpec, temperature_auto
from tq_kernels.packing import pack_codes, packed_row_bytes
from tq_kernels.reference import dequantize_codes

CHUNK_ELEMENTS = 1 << 21
FP16_MAX = 65504.0


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight: W ~ (dequantized codes + outliers) @ R.T.

    Its stored keys, dtypes and shapes are the format's, named in tq_cli.io.format."""

    shape: tuple[int, int]
    spec: QuantSpec
    rotation: Rotation
    codes: torch.Tensor  # uint8 [out, packed_row_bytes(in, bits)]
    scales: torch.Tensor  # float16 [out, ceil(in / group_size)]
    codebook: torch.Tensor  # float32 [2**bits], ascending
    outlier_idx: torch.Tensor  # int32 [k], row-major flat index into [out, in]
    outlier_val: torch.Tensor  # float16 [k], added to the dequantized value there
    rel_error: float  # ||W - W_hat||^2 / ||W||^2 of what is stored
    # float16 [in]: W = W' diag(t), W' the quantized weight (tq_cli.quant.colscale); None: off
    col_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of codes, scales, codebook, outliers and column scales (not the rotation
        material)."""
        parts = [self.codes, self.scales, self.codebook, self.outlier_idx, self.outlier_val]
        if self.col_scale is not None:
            parts.append(self.col_scale)
        return sum(t.numel() * t.element_size() for t in parts)


def group_count(n: int, group_size: int) -> int:
    return -(-n // group_size)


def outlier_count(numel: int, fraction: float) -> int:
    """How many entries are kept exactly; fixed by shape so outputs can be planned."""
    return math.floor(numel * fraction)


def dequantize_rotated(q: QuantizedTensor) -> torch.Tensor:
    """W_hat @ R in float32: what the kernels multiply rotated activations with. Built a
    block of rows at a time, so the unpacking's temporaries (int64 codes: twice the
    result) stay a few MB (a 49152 x 4096 head's were 2.4 GB)."""
    out, n = q.shape
    w = torch.empty(out, n, dtype=torch.float32, device=q.codes.device)
    for r0, r1 in row_blocks(q):
        w[r0:r1] = dequantize_codes(q.codes[r0:r1], q.scales[r0:r1], q.codebook,
                                    bits=q.spec.bits, group_size=q.spec.group_size,
                                    in_features=n)
    if q.outlier_idx.numel():
        w.view(-1).index_add_(0, q.outlier_idx.long(), q.outlier_val.float())
    return w


def sq_norm(t: torch.Tensor) -> float:
    """||t||^2 summed in float64, a chunk at a time: vector_norm(t, dtype=float64) first
    converts the whole tensor to float64 (1.6 GB beside an 8B-sized head)."""
    flat = t.reshape(-1)
    return sum(float(torch.linalg.vector_norm(flat[i:i + CHUNK_ELEMENTS],
                                              dtype=torch.float64)) ** 2
               for i in range(0, flat.numel(), CHUNK_ELEMENTS))


def row_blocks(q: QuantizedTensor) -> list[tuple[int, int]]:
    """Row ranges of about CHUNK_ELEMENTS entries covering q."""
    out, n = q.shape
    rows = max(1, CHUNK_ELEMENTS // max(1, n))
    return [(r, min(r + rows, out)) for r in range(0, out, rows)]


def dequantize_rows(q: QuantizedTensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0..r1 of `dequantize_rotated(q)`, outliers included."""
    n = q.shape[1]
    w = dequantize_codes(q.codes[r0:r1], q.scales[r0:r1], q.codebook, bits=q.spec.bits,
                         group_size=q.spec.group_size, in_features=n)
    if q.outlier_idx.numel():
        idx = q.outlier_idx.long()
        sel = (idx >= r0 * n) & (idx < r1 * n)
        if bool(sel.any()):
            w.view(-1).index_add_(0, idx[sel] - r0 * n, q.outlier_val[sel].float())
    return w


def with_col_scale(q: QuantizedTensor, w_scaled_rot: torch.Tensor, t: torch.Tensor,
                   norm: float | None = None) -> QuantizedTensor:
    """`q`, the fit of the column-scaled rotated weight, with t stored and its error
    measured on the weight it stands for (tq_cli.quant.colscale); `norm`: ||W||^2 of the
    original weight where the caller has it."""
    err = 0.0
    for r0, r1 in row_blocks(q):  # a block of rows at a time: no second full-size copy
        d = w_scaled_rot[r0:r1].float() - dequantize_rows(q, r0, r1).to(w_scaled_rot.device)
        err += _unrotated_sq(d.contiguous(), t, q.rotation)
    if norm is None:
        norm = _unrotated_sq(w_scaled_rot.float().clone(), t, q.rotation)
    return replace(q, col_scale=t.half().cpu(), rel_error=err / norm if norm > 0 else 0.0)


def _unrotated_sq(x: torch.Tensor, t: torch.Tensor, rotation: Rotation) -> float:
    """||unrotate(x) diag(t)||^2 for an x [out, in] the caller gives up. A Hadamard
    rotation's unrotate is the blockwise Walsh-Hadamard transform times the signs, which
    the square drops: on the CPU that is tq's native in-place rotation with no signs."""
    if (rotation.kind == "hadamard" and x.device.type == "cpu" and x.is_contiguous()
            and native_available()):
        from tq_kernels import fit as native

        native.rotate_(x, torch.ones(x.shape[1], dtype=torch.int8), rotation.block)
        return sq_norm(x.mul_(t.to(x.device)))
    return true_sq(x, t, rotation)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """W_hat in the original basis, float32 [out, in]."""
    w = q.rotation.unrotate(dequantize_rotated(q))
    return w * q.col_scale.float().to(w.device) if q.col_scale is not None else w


class _Fit:
    """State of one tensor's fit in torch ops (any device): padded row chunks, group scales
    and the codebook. `_NativeFit` is the same fit on the CPU in one native pass each."""

    def __init__(self, w: torch.Tensor, spec: QuantSpec, device: torch.device) -> None:
        # On a GPU the whole weight moves once, not once per pass and chunk.
        self.w, self.spec, self.device = w.to(device, torch.float32), spec, device
        self.out, self.n = w.shape
        self.g = spec.group_size
        self.groups = group_count(self.n, self.g)
        self.npad = self.groups * self.g
        self.rows = max(1, CHUNK_ELEMENTS // self.npad)
        cols = torch.arange(self.npad, device=device) < self.n
        self.colmask = cols.view(self.groups, self.g)
        self.codebook = initial_codebook(spec.codebook, spec.bits).to(device)
        self.scales = torch.empty(self.out, self.groups, dtype=torch.float32, device=device)
        self.outliers = torch.empty(0, dtype=torch.long, device=device)

    def chunks(self) -> list[tuple[int, int]]:
        return [(r, min(r + self.rows, self.out)) for r in range(0, self.out, self.rows)]

    def load(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded chunk [R, G, g] and its mask of entries that count (valid, not outlier)."""
        x = self.w[r0:r1]
        x = F.pad(x, (0, self.npad - self.n)).view(r1 - r0, self.groups, self.g)
        mask = self.colmask.expand(r1 - r0, -1, -1).clone()
        if self.outliers.numel():
            sel = self.outliers[(self.outliers >= r0 * self.n) & (self.outliers < r1 * self.n)]
            rows, cols = (sel - r0 * self.n) // self.n, (sel - r0 * self.n) % self.n
            mask[rows, cols // self.g, cols % self.g] = False
        return x, mask

    def init_scales(self) -> None:
        for r0, r1 in self.chunks():
            x, m = self.load(r0, r1)
            if self.spec.codebook == "uniform":
                s = (x.abs() * m).amax(dim=-1)
            else:
                s = ((x * x * m).sum(-1) / m.sum(-1).clamp(min=1)).sqrt()
            self.scales[r0:r1] = s

    @staticmethod
    def _safe(s: torch.Tensor) -> torch.Tensor:
        return torch.where(s > 0, s, torch.ones_like(s))

    def _window(self, t: torch.Tensor) -> torch.Tensor:
        o = self.spec.window_overlap
        flat = t.reshape(t.shape[0], self.npad)
        return F.pad(flat, (o, o)).unfold(-1, self.g + 2 * o, self.g)

    def _own(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes of a group's own columns out of its overlapping window."""
        o = self.spec.window_overlap
        return codes[..., o:o + self.g]

    def iterate(self) -> None:
        """One pass: assign, least-squares scales, then codebook (k-means) refinement."""
        levels = self.codebook.numel()
        num = torch.zeros(levels, dtype=torch.float64, device=self.device)
        den = torch.zeros(levels, dtype=torch.float64, device=self.device)
        for r0, r1 in self.chunks():
            x, m = self.load(r0, r1)
            s = self.scales[r0:r1]
            if self.spec.window_overlap:
                xw, mw = self._window(x), self._window(m.to(x.dtype))
            else:
                xw, mw = x, m.to(x.dtype)
            codes = nearest(xw / self._safe(s)[..., None], self.codebook)
            q = self.codebook[codes]
            n_ls, d_ls = (mw * xw * q).sum(-1), (mw * q * q).sum(-1)
            s = torch.where(d_ls > 0, n_ls / d_ls.clamp(min=1e-30), s).clamp(max=FP16_MAX)
            self.scales[r0:r1] = s
            if self.spec.codebook == "uniform":
                continue
            if self.spec.window_overlap:
                codes = self._own(codes)
            # Levels given these codes and the new scales: an exact minimisation too.
            sm = s[..., None] * m
            if self.spec.temperature is None:
                flat = codes.reshape(-1)
                num += torch.bincount(flat, weights=(sm * x).reshape(-1).double(), minlength=levels)
                den += torch.bincount(flat, weights=(sm * s[..., None]).reshape(-1).double(),
                                      minlength=levels)
            else:
                z = (x / self._safe(s)[..., None])[m]
                ss = s[..., None].expand_as(x)[m]
                temp = self.spec.temperature
                t = temperature_auto(self.n, self.g) if temp == "auto" else float(temp)
                t2 = t * t
                r = torch.softmax(-0.5 * t2 * (z[:, None] - self.codebook) ** 2, dim=-1)
                num += (r * (ss * x[m])[:, None]).sum(0).double()
                den += (r * (ss * ss)[:, None]).sum(0).double()
        if self.spec.codebook != "uniform":
            upd = torch.where(den > 0, num / den.clamp(min=1e-300), self.codebook.double())
            self.codebook = torch.sort(upd.float()).values

    def residual_chunks(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]]:
        """(r0, r1, x, codes, residual) per chunk, one chunk alive at a time."""
        for r0, r1 in self.chunks():
            x, _ = self.load(r0, r1)
            s = self.scales[r0:r1][..., None]
            codes = nearest(x / self._safe(s), self.codebook)
            resid = (x - self.codebook[codes] * s) * self.colmask
            yield r0, r1, x, codes, resid

    def pick_outliers(self, k: int) -> None:
        best_v = torch.empty(0, device=self.device)
        best_i = torch.empty(0, dtype=torch.long, device=self.device)
        for r0, r1, _x, _codes, resid in self.residual_chunks():
            a = resid.reshape(r1 - r0, self.npad)[:, : self.n].reshape(-1).abs()
            v, i = torch.topk(a, min(k, a.numel()))
            best_v = torch.cat([best_v, v])
            best_i = torch.cat([best_i, i + r0 * self.n])
            if best_v.numel() > k:
                best_v, j = torch.topk(best_v, k)
                best_i = best_i[j]
        self.outliers = torch.sort(best_i).values

    def final(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Packed codes, the outliers' fp16 residuals, squared error and squared norm."""
        out, n, spec = self.out, self.n, self.spec
        codes_out = torch.empty(out, packed_row_bytes(n, spec.bits), dtype=torch.uint8)
        out_val = torch.empty(0, dtype=torch.float16)
        err = 0.0
        norm = 0.0
        oi = self.outliers
        for r0, r1, x, codes, resid in self.residual_chunks():
            flat_codes = codes.reshape(r1 - r0, self.npad)[:, :n]
            codes_out[r0:r1] = pack_codes(flat_codes, spec.bits).cpu()
            flat_res = resid.reshape(r1 - r0, self.npad)[:, :n].reshape(-1)
            sel = oi[(oi >= r0 * n) & (oi < r1 * n)] - r0 * n
            vals = flat_res[sel].clamp(-FP16_MAX, FP16_MAX).half()
            flat_res = flat_res.clone()
            flat_res[sel] -= vals.float()
            out_val = torch.cat([out_val, vals.cpu()])
            err += float(flat_res.double().pow(2).sum())
            norm += float(x.double().pow(2).sum())
        return codes_out, out_val, err, norm


class _NativeFit:
    """The same fit as `_Fit` on the CPU, each pass one native read of the weight
    (tq_kernels.fit; csrc/fit_cpu.cpp). No window overlap or temperature: those run in
    torch ops."""

    def __init__(self, w: torch.Tensor, spec: QuantSpec) -> None:
        from tq_kernels import fit as native

        self.native = native
        self.w = w.to(torch.float32).contiguous()
        self.spec = spec
        self.out, self.n = self.w.shape
        self.g = spec.group_size
        self.codebook = initial_codebook(spec.codebook, spec.bits)
        self.scales = torch.empty(self.out, group_count(self.n, self.g), dtype=torch.float32)
        self.outliers = torch.empty(0, dtype=torch.long)

    def init_scales(self) -> None:
        self.scales = self.native.init_scales(self.w, self.g, self.outliers,
                                              self.spec.codebook == "uniform")

    def iterate(self) -> None:
        refine = self.spec.codebook != "uniform"
        stats = self.native.fit_pass(self.w, self.scales, self.codebook, self.g,
                                     self.outliers, refine)
        if refine:
            num, den = stats[0], stats[1]
            upd = torch.where(den > 0, num / den.clamp(min=1e-300), self.codebook.double())
            self.codebook = torch.sort(upd.float()).values.contiguous()

    def pick_outliers(self, k: int) -> None:
        self.outliers = self.native.top_outliers(self.w, self.scales, self.codebook, self.g, k)

    def final(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        return self.native.finish(self.w, self.scales.contiguous(), self.codebook, self.g,
                                  self.spec.bits, self.outliers)


def native_available() -> bool:
    """Whether the native CPU fit can run here: it built, and TQ_FIT=torch does not ask for
    the torch version (the reference, and for comparisons)."""
    if os.environ.get("TQ_FIT", "").strip().lower() == "torch":
        return False
    from tq_kernels import fit as native

    return native.available()


def set_fit_threads(threads: int) -> None:
    """Threads the calling thread's native fit uses from now on (0: torch's intra-op
    count); the conversion pipeline runs one per tensor and two tensors at a time."""
    if native_available():
        from tq_kernels import fit as native

        native.set_threads(threads)


def _native(spec: QuantSpec, dev: torch.device) -> bool:
    """The native fit runs on the CPU, without the torch-only options."""
    if dev.type != "cpu" or spec.window_overlap or spec.temperature is not None:
        return False
    return native_available()


def scan_values(w: torch.Tensor) -> tuple[int, int]:
    """(NaN/Inf values, finite values beyond what fp16 holds) in a float32 CPU weight."""
    if native_available():
        from tq_kernels import fit as native

        return native.scan(w)
    finite = torch.isfinite(w)
    nonfinite = int((~finite).sum())
    huge = int(((w.abs() > FP16_MAX) & finite).sum())
    return nonfinite, huge


def rotate_owned(w: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """w @ R for a contiguous float32 CPU weight the caller owns and no longer needs: the
    Hadamard rotation runs natively in place (bit for bit the torch result), so no second
    full-size copy exists; other rotations allocate the result."""
    if (rotation.kind == "hadamard" and rotation.signs is not None and w.is_contiguous()
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
            and native_available()):
        from tq_kernels import fit as native

        return native.rotate_(w, rotation.signs, rotation.block)
    return rotation.rotate_rows(w)


def _fitted(w_rot: torch.Tensor, spec: QuantSpec, dev: torch.device) -> _Fit | _NativeFit:
    """The data-free fit after its iterations, scales rounded to the stored fp16."""
    fit: _Fit | _NativeFit = (_NativeFit(w_rot, spec) if _native(spec, dev)
                              else _Fit(w_rot, spec, dev))
    fit.init_scales()
    for _ in range(spec.scale_iters):
        fit.iterate()
    k = outlier_count(fit.out * fit.n, spec.outliers)
    if k:
        # Outliers are the largest residuals; refit without them so they stop pulling
        # scales and levels, then store their exact residuals.
        fit.pick_outliers(k)
        for _ in range(min(2, spec.scale_iters)):
            fit.iterate()
    # Assign with the scales that are stored; fp16 holds them only up to FP16_MAX.
    fit.scales = fit.scales.clamp(-FP16_MAX, FP16_MAX).half().float()
    return fit


def fit_grid(w_rot: torch.Tensor, spec: QuantSpec,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data-free grid of a rotated weight: (scales [out, groups] float32 holding the
    stored fp16 values, codebook [2**bits] float32 ascending), on `device`.

    Calibrated quantization (`tq_cli.quant.gptq`) assigns codes on this grid."""
    dev = torch.device(device) if device is not None else w_rot.device
    fit = _fitted(w_rot, spec, dev)
    return fit.scales.to(dev), fit.codebook.float().to(dev)


def quantize_rotated(w_rot: torch.Tensor, spec: QuantSpec, rotation: Rotation,
                     device: torch.device | str | None = None) -> QuantizedTensor:
    """Quantize an already rotated weight [out, in] (the pipeline rotates on another thread)."""
    dev = torch.device(device) if device is not None else w_rot.device
    fit = _fitted(w_rot, spec, dev)
    codes, out_val, err, norm = fit.final()
    return QuantizedTensor(
        shape=(fit.out, fit.n), spec=spec, rotation=rotation, codes=codes,
        scales=fit.scales.half().cpu(), codebook=fit.codebook.float().cpu(),
        outlier_idx=fit.outliers.to(torch.int32).cpu(), outlier_val=out_val.cpu(),
        rel_error=err / norm if norm > 0 else 0.0,
    )

"""The quantizer's native CPU fit, from Python: typed wrappers over `torch.ops.tq_fit`.

The passes of `tq_cli.quant.grouped`'s data-free fit (initial scales, assign + least-squares
scales + codebook statistics, top-k outliers, final codes packed with their error), each
one read of the weight (see csrc/fit_cpu.cpp). The library is built on first use
(`cpu_build`, separately from TQLinear's kernel); if that fails, `available()` is False,
one warning says why, and the quantizer runs its torch version. `TQ_CPU_ISA=avx2` (or
`scalar`) caps the instruction set as for the TQLinear kernel; `isa=` picks one in tests.
"""

from __future__ import annotations

import functools

import torch

from tq_kernels import cpu_build

ISAS = cpu_build.ISAS


@functools.lru_cache(maxsize=1)
def _built() -> cpu_build.Built:
    built = cpu_build.load(cpu_build.FIT)
    if built.error is not None:
        cpu_build.announce("native quantizer fit", built, "conversion runs the torch version "
                           "(several times slower)")
    return built


def available() -> bool:
    """True when the compiled fit is loaded (compiling it now if needed)."""
    return _built().path is not None


@functools.lru_cache(maxsize=1)
def _cap() -> int:
    if not available():
        raise RuntimeError(f"tq's native fit is unavailable: {_built().error}")
    return cpu_build.capped(int(torch.ops.tq_fit.isa()))


def _isa(isa: str | None) -> int:
    return cpu_build.isa_index(isa, _cap())  # _cap() loads the library


def init_scales(w: torch.Tensor, group: int, outliers: torch.Tensor, uniform: bool,
                isa: str | None = None) -> torch.Tensor:
    """Per-group RMS (absmax if `uniform`) of w [out, n] float32, ignoring `outliers`
    (ascending int64 flat indices): float32 [out, ceil(n / group)]."""
    i = _isa(isa)  # loads the library first
    return torch.ops.tq_fit.init.default(w, group, outliers, uniform, i)


def fit_pass(w: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, group: int,
             outliers: torch.Tensor, refine: bool, isa: str | None = None) -> torch.Tensor:
    """One pass: nearest levels, least-squares scales (updated in place), and, if `refine`,
    the codebook update's sums: float64 [2, levels] (num, den), else zeros."""
    i = _isa(isa)
    return torch.ops.tq_fit.pass_.default(w, scales, codebook, group, outliers, refine, i)


def top_outliers(w: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, group: int,
                 k: int, isa: str | None = None) -> torch.Tensor:
    """Flat indices of the k largest |w - q * s| (ties: lower index), ascending, int64."""
    i = _isa(isa)
    return torch.ops.tq_fit.outliers.default(w, scales, codebook, group, k, i)


def finish(w: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, group: int,
           bits: int, outliers: torch.Tensor, isa: str | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Packed codes (tq_kernels.packing layout), the outliers' fp16 residuals, and the
    squared error (after the outliers) and squared norm of w."""
    i = _isa(isa)
    packed, vals, en = torch.ops.tq_fit.finish.default(w, scales, codebook, group, bits,
                                                       outliers, i)
    return packed, vals, float(en[0]), float(en[1])


def gptq_block_(w1: torch.Tensor, u1: torch.Tensor, st: torch.Tensor, gcol: torch.Tensor,
                codebook: torch.Tensor, mask: torch.Tensor | None, codes: torch.Tensor,
                q: torch.Tensor, e: torch.Tensor, isa: str | None = None) -> None:
    """One block of GPTQ's column loop (tq_cli.quant.gptq): for each of the block's columns
    w1[i] (rows of W^T, float32 [b, out], error-fed in place) the nearest codes, their
    values q (outliers, where `mask` is 1, keep their fp16 residual) and the scaled errors
    e = (w1[i] - q) / u1[i, i], fed onto the later columns through u1 [b, b]."""
    i = _isa(isa)
    empty = torch.empty(0, dtype=torch.uint8)
    torch.ops.tq_fit.gptq_block_.default(w1, u1, st, gcol, codebook,
                                         empty if mask is None else mask, codes, q, e, i)


def rotate_(w: torch.Tensor, signs: torch.Tensor, block: int, isa: str | None = None,
            ) -> torch.Tensor:
    """w @ R in place for the blockwise randomized Hadamard R (w contiguous float32
    [rows, n], signs int8 ±1 [n]); bit for bit `tq_kernels.rotation.hadamard_rotate`."""
    i = _isa(isa)
    torch.ops.tq_fit.rotate_.default(w, signs.to(torch.int8).contiguous(), block, i)
    return w


def scan(w: torch.Tensor) -> tuple[int, int]:
    """(values that are NaN or infinite, finite values beyond ±65504) in float32 w."""
    _isa(None)
    res = torch.ops.tq_fit.scan.default(w.contiguous())
    return int(res[0]), int(res[1])


def cpu_isa() -> str:
    """The widest variant this CPU runs (ignoring TQ_CPU_ISA)."""
    _isa(None)
    return ISAS[int(torch.ops.tq_fit.isa())]


def active_isa() -> str:
    """The variant that runs: cpu_isa() capped by TQ_CPU_ISA."""
    return ISAS[_cap()]


def set_threads(threads: int) -> None:
    """Threads the calling thread's fit calls use from now on (0: torch's intra-op count).
    One thread runs without any parallel region."""
    _isa(None)
    torch.ops.tq_fit.set_threads.default(threads)

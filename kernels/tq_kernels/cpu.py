"""TQLinear's native CPU kernel, from Python: typed wrappers over `torch.ops.tq_cpu`.

`linear` is a whole TQLinear forward in one call: Hadamard rotation, the packed-weight
matmul, the sparse outliers and the bias (see csrc/tq_cpu.cpp). The library is built on
first use (`cpu_build`); if that fails, `available()` is False, one warning says why, and
`tq_kernels.dispatch` runs the torch reference instead.

The prefill path's GEMM (from GEMM_MIN_BATCH rows) multiplies in bfloat16 with float32
accumulation on CPUs with native bf16 dot products (AVX512-BF16 or AMX), whatever the
activations' dtype: about twice the fp32 GEMM's rate, and the rounding is small next to
the 4-bit weight's own error (docs/decisions.md). `TQ_CPU_GEMM=fp32` keeps float32
products for a process, `set_gemm_precision()` switches from Python, `gemm_precision()`
says which one runs. That GEMM is torch's (oneDNN), so TQ_CPU_ISA does not cap it.
Decode-sized batches take the lookup-table GEMV in float32, except one activation row of
a 2-4-bit layer (and of an 8-bit one on an affine grid: the head),
which takes faster products where the CPU has them, under the same switch: int8 ones on
CPUs with AVX512-VNNI (2- and 3-bit layers also need VBMI) and in the AVX2 variant
(csrc/int8_gemv.h, llama.cpp's way: activations rounded to int8 per group), bf16 ones on
AVX512-BF16 CPUs otherwise (csrc/bf16_gemv.h, 1.2-1.7x the float32 GEMV's rate).
`TQ_CPU_GEMV=bf16` (or `set_gemv_products("bf16")`) keeps bf16 products instead of int8
ones; `gemv_products` says which runs.

Variants are named by instruction set: "avx512", "avx2", "scalar". The best one the CPU
supports is used; `TQ_CPU_ISA=avx2` (or `scalar`) caps it for a process, and tests pass
`isa=` to run each variant on the same machine. A layer whose group size does not hold
whole SIMD chunks runs the widest variant that fits (`kernel_isa`).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from tq_kernels import cpu_build

ISAS = cpu_build.ISAS

# From this many activation rows on, dequantizing row blocks once and calling torch's
# GEMM beats the lookup-table GEMV, which redoes the lookups for every 4 rows. Measured
# with scripts/bench_cpu_threshold.py on SmolLM2 and Llama-3-8B shapes (2-core AVX-512
# EPYC): the crossover is at 8-24 rows with float32 GEMM products and 12-32 (mostly
# 12-16) with bf16 ones, depending on width and bits.
GEMM_MIN_BATCH = 16
GEMM_PRECISIONS = ("fp32", "bf16")
GEMV_PRODUCTS = ("int8", "bf16")  # the one-row GEMV's products while GEMM products are bf16


@functools.lru_cache(maxsize=1)
def _built() -> cpu_build.Built:
    built = cpu_build.load()
    if built.error is not None:
        cpu_build.announce("native CPU kernel", built, "TQLinear runs the torch reference on "
                           "CPU (backend 'torch', several times slower)")
    else:
        # TQ_CPU_ISA's cap for the operators that pick a variant themselves (rotate,
        # decode attention, outlier values); _cap() applies it to the rest, and warns
        torch.ops.tq_cpu.set_isa_cap(cpu_build.capped(int(torch.ops.tq_cpu.cpu_isa())))
        _sync_gemv()
        try:
            _register_fakes()
        except (AttributeError, RuntimeError) as e:  # torch without register_fake (< 2.4)
            _fakes_error.append(str(e))
    return built


_fakes_error: list[str] = []


def traceable() -> bool:
    """Whether torch.compile can trace the operators (their shape-only implementations
    are registered; compiled decode steps need it)."""
    return available() and not _fakes_error


def _register_fakes() -> None:
    """Shapes of the operators' results, for torch.compile's tracing (the kernels run
    only on real tensors)."""

    def linear_fake(x: torch.Tensor, signs: torch.Tensor | None, block: int,
                    codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                    outlier_idx: torch.Tensor, outlier_val: torch.Tensor,
                    bias: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                    isa: int, gemm_min_batch: int, bf16_gemm: bool,
                    reuse_input: bool = True) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], out_features))

    def linear_registered_fake(x: torch.Tensor, handle: int, out_features: int
                               ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], out_features))

    def rotate_fake(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
        return x.new_empty(x.shape)  # the operator returns a contiguous tensor

    def decode_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              mask: torch.Tensor, scale: float) -> torch.Tensor:
        return q.new_empty((*q.shape[:-1], v.shape[-1]))  # contiguous, as the operator's

    torch.library.register_fake("tq_cpu::linear", linear_fake)
    torch.library.register_fake("tq_cpu::linear_registered", linear_registered_fake)
    torch.library.register_fake("tq_cpu::rotate", rotate_fake)
    torch.library.register_fake("tq_cpu::decode_attention", decode_attention_fake)


def available() -> bool:
    """True when the compiled kernel is loaded (compiling it now if needed)."""
    return _built().path is not None


def _require() -> None:
    if not available():
        raise RuntimeError(f"tq's CPU kernel is unavailable: {_built().error}")


@functools.lru_cache(maxsize=1)
def _cap() -> int:
    _require()
    return cpu_build.capped(int(torch.ops.tq_cpu.cpu_isa()), warn=True)


_requested: str | None = None  # set_gemm_precision(); None: TQ_CPU_GEMM, else bf16


_GEMM_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


@functools.lru_cache(maxsize=1)
def _fast_requested() -> bool:
    """Whether bf16 (fast) products are asked for: the operator's bf16_gemm flag. The
    kernel takes them only where the CPU has them (bf16 or, in the GEMV, int8 ones)."""
    env = os.environ.get("TQ_CPU_GEMM", "").strip().lower()
    want = _requested or _GEMM_ALIASES.get(env or "bf16")
    if want is None:  # a mistyped opt-out should not give what it tried to turn off
        warnings.warn(f"tq: TQ_CPU_GEMM={env!r} is not one of {', '.join(GEMM_PRECISIONS)}; "
                      "using fp32", RuntimeWarning, stacklevel=3)
        want = "fp32"
    return want == "bf16"


def _gemm_bf16() -> bool:
    return _fast_requested() and native_bf16_gemm()


_gemv_requested: str | None = None  # set_gemv_products(); None: TQ_CPU_GEMV, else int8


@functools.lru_cache(maxsize=1)
def _gemv_choice() -> str:
    env = os.environ.get("TQ_CPU_GEMV", "").strip().lower()
    want = _gemv_requested or (env if env in GEMV_PRODUCTS else None)
    if want is None and env:
        warnings.warn(f"tq: TQ_CPU_GEMV={env!r} is not one of {', '.join(GEMV_PRODUCTS)}; "
                      "using bf16", RuntimeWarning, stacklevel=3)
        want = "bf16"
    return want or "int8"


def gemv_choice() -> str:
    """The products asked for in the one-row GEMV of 2-4-bit layers (and affine 8-bit
    ones): "int8" or "bf16"
    (`set_gemv_products`, or TQ_CPU_GEMV as read when the kernel loaded or at the last
    `set_gemv_products` call); `gemv_products` says what a layer runs."""
    return _gemv_choice()


def _sync_gemv() -> None:
    torch.ops.tq_cpu.set_gemv_int8(_gemv_choice() == "int8")


def set_gemv_products(products: str | None) -> None:
    """Ask for "int8" (the default) or "bf16" products in the one-row GEMV of 2-4-bit
    layers (and affine 8-bit ones: "bf16" gives them float32) from
    now on, in this process, while bf16 products are asked for (int8 still needs the
    CPU's support, `native_int8_gemv`); None goes back to TQ_CPU_GEMV or the default.
    Unlike the GEMM's precision, a compiled decode step follows this at once."""
    global _gemv_requested
    if products is not None and products not in GEMV_PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(GEMV_PRODUCTS)}, "
                         f"got {products!r}")
    _require()
    _gemv_requested = products
    _gemv_choice.cache_clear()  # rereads TQ_CPU_GEMV
    _sync_gemv()


def native_int8_gemv(bits: int = 4, isa: str | None = None) -> bool:
    """Whether the int8 GEMV runs for this width (2-4 bits, or 8 on an affine grid) in a
    variant (default: the process's, TQ_CPU_ISA's cap included): AVX2 (vpmaddubsw) on any
    CPU that has it, at 2-4 bits and 8; AVX-512 with AVX512-VNNI's int8 dot products (and
    VBMI, at 2 and 3 bits) where the process runs AVX-512, at 2-4 bits and 8."""
    index = _isa_index(isa)  # loads the library first
    return bool(torch.ops.tq_cpu.int8_gemv(bits, index))


def native_bf16_gemm() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16 or AMX), which bf16 needs, and
    TQ_CPU_ISA does not cap the kernel below avx512 (a CPU without AVX-512 has neither)."""
    _require()
    return bool(torch.ops.tq_cpu.bf16_gemm())


def gemm_precision() -> str:
    """The product precision of the prefill path's GEMM now: "bf16" or "fp32" (and of the
    one-row GEMV of the layers `gemv_products` names)."""
    _require()
    return "bf16" if _gemm_bf16() else "fp32"


def gemv_products(bits: int, group_size: int, in_features: int, batch: int = 1,
                  affine: bool = False) -> str:
    """The product precision of a GEMV (below GEMM_MIN_BATCH rows) now, for one activation
    row of a 2-, 3- or 4-bit layer whose group size and width hold whole 64-code chunks,
    or an 8-bit one whose levels are an affine grid (affine: the quantized head's), while
    bf16 products are asked for (`set_gemm_precision`): "int8" with groups of at most
    2048 where `native_int8_gemv(bits, <the layer's variant>)`, while the GEMV's products
    are int8 (`set_gemv_products`, csrc/int8_gemv.h); else "bf16" on the AVX-512 variant
    of a CPU with bf16 dot products at 2-4 bits (csrc/bf16_gemv.h); "fp32" otherwise."""
    isa = kernel_isa(bits, group_size)
    fits = (batch == 1 and (2 <= bits <= 4 or (bits == 8 and affine))
            and group_size % 64 == 0 and in_features % 64 == 0 and isa in ("avx512", "avx2"))
    if not (fits and _fast_requested()):
        return "fp32"
    if group_size <= 2048 and _gemv_choice() == "int8" and native_int8_gemv(bits, isa):
        return "int8"
    return "bf16" if isa == "avx512" and bits <= 4 and native_bf16_gemm() else "fp32"


def set_gemm_precision(precision: str | None) -> None:
    """Ask for "fp32" or "bf16" GEMM products from now on, in this process (bf16 still
    needs the CPU's support); None goes back to TQ_CPU_GEMM or the default."""
    global _requested
    if precision is not None and precision not in GEMM_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(GEMM_PRECISIONS)}, "
                         f"got {precision!r}")
    _requested = precision
    _fast_requested.cache_clear()


def _isa_index(isa: str | None) -> int:
    return cpu_build.isa_index(isa, _cap())  # _cap() loads the library


def cpu_isa() -> str:
    """The widest variant this CPU runs (ignoring TQ_CPU_ISA)."""
    _require()
    return ISAS[int(torch.ops.tq_cpu.cpu_isa())]


def active_isa() -> str:
    """The variant that runs: cpu_isa() capped by TQ_CPU_ISA."""
    return ISAS[_cap()]


def kernel_isa(bits: int, group_size: int, isa: str | None = None) -> str:
    """The variant a layer of this width and group size runs."""
    index = _isa_index(isa)  # loads the library first
    return ISAS[int(torch.ops.tq_cpu.kernel_isa(index, bits, group_size))]


_EMPTY_IDX = torch.empty(0, dtype=torch.int32)
_EMPTY_VAL = torch.empty(0, dtype=torch.float16)


def linear(x: torch.Tensor, signs: torch.Tensor | None, block: int, codes: torch.Tensor,
           scales: torch.Tensor, codebook: torch.Tensor, outlier_idx: torch.Tensor | None,
           outlier_val: torch.Tensor | None, bias: torch.Tensor | None, *, bits: int,
           group_size: int, out_features: int, isa: str | None = None,
           gemm_min_batch: int | None = None, gemm: str | None = None) -> torch.Tensor:
    """y = rotate(x) @ dequant(W).T + outliers + bias for x [..., in]; y has x's dtype.

    signs None means x is already rotated (orthogonal rotations, or none). gemm_min_batch
    overrides GEMM_MIN_BATCH (0: never the GEMM path); gemm ("fp32" or "bf16") overrides
    gemm_precision() (bf16 still needs the CPU's support). Operands are passed as they are:
    the operator converts what is not already in its dtype (a decode step calls this 200
    times per token, so Python-side conversions would cost more than the matmul).
    """
    isa_i = _cap() if isa is None else _isa_index(isa)
    if gemm is not None and gemm not in GEMM_PRECISIONS:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_PRECISIONS)}, got {gemm!r}")
    if outlier_idx is None or outlier_val is None:
        outlier_idx, outlier_val = _EMPTY_IDX, _EMPTY_VAL
    return torch.ops.tq_cpu.linear.default(
        x, signs, block, codes, scales, codebook, outlier_idx, outlier_val, bias, bits,
        group_size, out_features, isa_i,
        GEMM_MIN_BATCH if gemm_min_batch is None else gemm_min_batch,
        _fast_requested() if gemm is None else gemm == "bf16",
        # traced (a user's own torch.compile): no input reuse (see native_args)
        not torch.compiler.is_compiling())


def native_args() -> tuple[int, int, bool, bool]:
    """The settings `linear` passes the operator now (instruction set, GEMM batch
    threshold, bf16 GEMM products), for a caller that records the operator itself
    (TQLinear in a compiled step), with reuse_input off: a compiled graph rewrites its
    buffers in place without a version bump, so the operator must not take an input for
    the one it rotated last."""
    _require()
    return _cap(), GEMM_MIN_BATCH, _fast_requested(), False


def register(signs: torch.Tensor | None, block: int, codes: torch.Tensor,
             scales: torch.Tensor, codebook: torch.Tensor, outlier_idx: torch.Tensor,
             outlier_val: torch.Tensor, bias: torch.Tensor | None, *, bits: int,
             group_size: int, in_features: int, out_features: int,
             native: tuple[int, int, bool, bool] | None = None, handle: int = -1) -> int:
    """Check a layer once and keep it in the kernel library (references to its tensors, no
    copy where they are in the kernel's dtypes) with the settings of `native` (default:
    `native_args()`); returns the handle `linear_registered` calls it by. handle >= 0
    replaces that registered layer (its tensors changed) and keeps the handle. The caller
    unregisters it (`unregister`) when it is done with it."""
    isa, gemm_min_batch, bf16, _ = native_args() if native is None else native
    return int(torch.ops.tq_cpu.register_layer(
        signs, block, codes, scales, codebook, outlier_idx, outlier_val, bias, bits,
        group_size, in_features, out_features, isa, gemm_min_batch, bf16, handle))


def unregister(handle: int) -> None:
    """Drop a registered layer (its tensors' references); an unknown handle is ignored."""
    if available():
        torch.ops.tq_cpu.unregister_layer(handle)


def registered() -> int:
    """How many layers are registered now."""
    return int(torch.ops.tq_cpu.registered_layers()) if available() else 0


def linear_registered(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """`linear` through a registered layer: the same result, bit for bit, without the
    packed tensors as arguments (what a compiled decode step records, one operator per
    layer; input reuse off, as `native_args`)."""
    return torch.ops.tq_cpu.linear_registered.default(x, handle, out_features)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """SDPA of one query token [B, Hq, 1, D] over a static cache k/v [B, Hkv, S, D] (grouped
    heads read in place), reading only the run of positions the bool mask [B or 1, 1, 1, S]
    leaves unmasked; [B, Hq, 1, Dv], contiguous. float32 heads of a multiple of 16 (up to
    256) run tq's own AVX-512 loop where the CPU has it (csrc/attention_avx512.h: half the
    time of SDPA's per-call setup at decode sizes), others torch's SDPA."""
    _require()
    return torch.ops.tq_cpu.decode_attention.default(q, k, v, mask, scale)


def rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x @ R for the blockwise randomized Hadamard R, in x's dtype (reference.rotate)."""
    _require()
    return torch.ops.tq_cpu.rotate.default(x, signs, block)

"""Attention over TurboQuant-coded KV-cache tokens: the two products of a decode step,
read straight from the packed codes, on the fastest kernel the tensors' device has.

    score_codes(q, codes, scale, levels, bits)         -> float32 [B, H, G, T]
    accumulate_codes(p, codes, scale, levels, bits, d) -> float32 [B, H, G, d]

with the semantics of `tq_kernels.kv_reference` (its docstring). CPU tensors run tq's
native kernel (csrc/kv_cpu.cpp, built on first use by `cpu_build` as its own library,
`torch.ops.tq_kv`) for 1- to 5-bit codes with float16 scales; CUDA tensors run
`tq_kernels.kv_triton`; anything else, a failed build or import, `TQ_FORCE_REFERENCE`, or
inputs that need gradients run the torch reference. `backend_for` says which.

The native kernel's variants are named by instruction set: "avx512", "avx2", "scalar".
The best one the CPU supports runs; `TQ_CPU_ISA=avx2` (or `scalar`) caps it for a
process, and tests pass `isa=` to run each variant on the same machine. It uses torch's
intra-op threads (`torch.set_num_threads`) for long caches, and its results do not
depend on the thread count.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from tq_kernels import cpu_build, kv_reference

ISAS = cpu_build.ISAS
NATIVE_BITS = (1, 2, 3, 4, 5)
MAIN = cpu_build.KV


@functools.lru_cache(maxsize=1)
def _built() -> cpu_build.Built:
    built = cpu_build.load(MAIN)
    if built.error is not None:
        cpu_build.announce("native KV-cache attention kernel", built,
                           "coded KV attention runs the torch reference on CPU")
    return built


def available() -> bool:
    """True when the compiled kernel is loaded (compiling it now if needed)."""
    return _built().path is not None


@functools.lru_cache(maxsize=1)
def _cap() -> int:
    if not available():
        raise RuntimeError(f"tq's KV-cache attention kernel is unavailable: {_built().error}")
    return cpu_build.capped(int(torch.ops.tq_kv.isa()))


def _isa(isa: str | None) -> int:
    return cpu_build.isa_index(isa, _cap())  # _cap() loads the library


def cpu_isa() -> str:
    """The widest variant this CPU runs (ignoring TQ_CPU_ISA)."""
    _cap()
    return ISAS[int(torch.ops.tq_kv.isa())]


def active_isa() -> str:
    """The variant that runs: cpu_isa() capped by TQ_CPU_ISA."""
    return ISAS[_cap()]


def isas() -> tuple[str, ...]:
    """Every variant this CPU runs, narrowest first (what tests compare)."""
    return ISAS[:ISAS.index(cpu_isa()) + 1]


@functools.lru_cache(maxsize=1)
def _triton() -> ModuleType | None:
    try:
        from tq_kernels import kv_triton
    except Exception:  # Triton missing, the module broken or absent: the reference runs
        return None
    return kv_triton


def _forced_reference() -> bool:
    return bool(os.environ.get("TQ_FORCE_REFERENCE"))


def backend_for(device: torch.device | str) -> str:
    """What `score_codes` and `accumulate_codes` run on for tensors on `device` (with
    1- to 5-bit codes): "cpu-avx512", "cpu-avx2", "cpu-scalar", "triton" or "torch"."""
    dev = torch.device(device)
    if _forced_reference():
        return "torch"
    if dev.type == "cuda":
        return "triton" if _triton() is not None else "torch"
    if dev.type == "cpu" and available():
        return f"cpu-{ISAS[_cap()]}"
    return "torch"


def _native(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bits: int,
            isa: str | None) -> bool:
    """Whether this call runs the native CPU kernel (isa= asks for it explicitly)."""
    if (x.device.type != "cpu" or codes.device.type != "cpu" or bits not in NATIVE_BITS
            or scale.dtype != torch.float16 or codes.dtype != torch.uint8):
        return False
    if isa is not None:
        return True
    # The op has no autograd formula: inputs that need gradients take the reference.
    return (not _forced_reference() and available()
            and not (x.requires_grad and torch.is_grad_enabled()))


def _float_operand(x: torch.Tensor) -> torch.Tensor:
    # No copy when x is already contiguous float32 (a decode step calls this per layer).
    x = x.detach() if x.requires_grad else x
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def _codes_operand(codes: torch.Tensor) -> torch.Tensor:
    # Any strides over B, H, T are read as they are; only the bytes of a row must be
    # contiguous.
    return codes if codes.dim() != 4 or codes.stride(-1) == 1 else codes.contiguous()


def score_codes(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                levels: torch.Tensor, bits: int, *, isa: str | None = None) -> torch.Tensor:
    """float32 [B, H, G, T]: |s_t| <q_g, L[codes_t]> for q [B, H, G, d] (rotated into the
    codes' basis), codes uint8 [B, H, T, bytes], scale float16 [B, H, T], levels
    [2**bits]. `isa` runs that native CPU variant (tests)."""
    if _native(q, codes, scale, bits, isa):
        i = _isa(isa)
        return torch.ops.tq_kv.score.default(
            _float_operand(q), _codes_operand(codes), scale, _float_operand(levels), bits, i)
    if q.device.type == "cuda" and backend_for(q.device) == "triton":
        impl = _triton()
        if impl is not None:
            out: torch.Tensor = impl.score_codes(q, codes, scale, levels, bits)
            return out
    return kv_reference.score_codes(q, codes, scale, levels, bits)


def accumulate_codes(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     levels: torch.Tensor, bits: int, d: int, *,
                     isa: str | None = None) -> torch.Tensor:
    """float32 [B, H, G, d]: sum_t p_t |s_t| L[codes_t] for p [B, H, G, T] (the attention
    weights), codes, scale and levels as in `score_codes`; the result is in the codes'
    rotated basis. `isa` runs that native CPU variant (tests)."""
    if _native(p, codes, scale, bits, isa):
        i = _isa(isa)
        return torch.ops.tq_kv.accumulate.default(
            _float_operand(p), _codes_operand(codes), scale, _float_operand(levels), bits, d,
            i)
    if p.device.type == "cuda" and backend_for(p.device) == "triton":
        impl = _triton()
        if impl is not None:
            out: torch.Tensor = impl.accumulate_codes(p, codes, scale, levels, bits, d)
            return out
    return kv_reference.accumulate_codes(p, codes, scale, levels, bits, d)

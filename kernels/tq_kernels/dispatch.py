"""Pick the kernel for a tensor's device: Triton on CUDA, tq's native kernel on CPU, or
the torch reference.

CUDA tensors use Triton when it imports and launches. CPU tensors use the compiled CPU
kernel (`tq_kernels.cpu`, built on first use) when it builds and loads. Everything else,
and everything when `TQ_FORCE_REFERENCE` is set, uses the reference. The caller is told
which via `backend_for`, so a slow fallback is never silent: "triton", "cpu-avx512",
"cpu-avx2", "cpu-scalar" or "torch".
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from tq_kernels import cpu, reference


@functools.lru_cache(maxsize=1)
def _triton() -> ModuleType | None:
    try:
        from tq_kernels import triton_kernels
    except Exception:  # Triton missing or unable to initialise: the reference runs
        return None
    return triton_kernels


def _forced_reference() -> bool:
    return bool(os.environ.get("TQ_FORCE_REFERENCE"))


def _native_cpu(x: torch.Tensor) -> bool:
    # The native op has no autograd formula: a forward that needs gradients through x
    # (an adapter trained on top of a frozen tq model) takes the differentiable reference.
    return (x.device.type == "cpu" and not _forced_reference() and cpu.available()
            and not (x.requires_grad and torch.is_grad_enabled()))


def backend_for(device: torch.device | str, bits: int | None = None,
                group_size: int | None = None) -> str:
    """What `grouped_matmul`, `rotate` and `linear` run on that device.

    On CPU, with bits and group_size, the variant a layer of that shape runs (a group
    size that does not hold whole SIMD chunks drops to a narrower one).
    """
    dev = torch.device(device)
    if _forced_reference():
        return "torch"
    if dev.type == "cuda":
        return "triton" if _triton() is not None else "torch"
    if dev.type == "cpu" and cpu.available():
        if bits is None or group_size is None:
            return f"cpu-{cpu.kernel_isa(4, 128)}"
        return f"cpu-{cpu.kernel_isa(bits, group_size)}"
    return "torch"


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   codebook: torch.Tensor, *, bits: int, group_size: int, out_features: int,
                   in_features: int) -> torch.Tensor:
    if _native_cpu(x):
        return cpu.linear(x, None, 0, codes, scales, codebook, None, None, None, bits=bits,
                          group_size=group_size, out_features=out_features)
    impl = _triton() if backend_for(x.device) == "triton" and bits in (2, 3, 4, 8) else None
    fn = impl.grouped_matmul if impl is not None else reference.grouped_matmul
    return fn(x, codes, scales, codebook, bits=bits, group_size=group_size,
              out_features=out_features, in_features=in_features)


def rotate(x: torch.Tensor, material: reference.Material, block: int) -> torch.Tensor:
    if isinstance(material, torch.Tensor) and _native_cpu(x):
        return cpu.rotate(x, material, block)
    impl = _triton() if backend_for(x.device) == "triton" else None
    fn = impl.rotate if impl is not None else reference.rotate
    return fn(x, material, block)


def scale_columns(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x * t over the last dimension, for a weight stored with column scales t
    (W = W' diag(t)). In float32 when x is float16: t reaches 2^15, and x * t could pass
    fp16's range where the layer's output would not; the caller casts the output back."""
    if x.dtype == torch.float16:
        return x.float() * t.float()
    return x * t.to(x.dtype)


def linear(x: torch.Tensor, material: reference.Material | None, block: int,
           codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
           outlier_idx: torch.Tensor, outlier_val: torch.Tensor, bias: torch.Tensor | None,
           *, bits: int, group_size: int, out_features: int, in_features: int) -> torch.Tensor:
    """A whole TQLinear forward: (x @ R) @ dequant(W).T + outliers + bias.

    material None means no rotation. On CPU one native call does it all (an orthogonal
    rotation, a small dense matmul, runs in torch first); elsewhere the steps run apart.
    """
    if _native_cpu(x):
        signs = material if isinstance(material, torch.Tensor) else None
        if material is not None and signs is None:
            x = reference.rotate(x, material, block)
        return cpu.linear(x, signs, block, codes, scales, codebook, outlier_idx, outlier_val,
                          bias, bits=bits, group_size=group_size, out_features=out_features)
    x_rot = rotate(x, material, block) if material is not None else x
    y = grouped_matmul(x_rot, codes, scales, codebook, bits=bits, group_size=group_size,
                       out_features=out_features, in_features=in_features)
    y = reference.add_outliers(y, x_rot, outlier_idx, outlier_val, in_features)
    return y + bias.to(y.dtype) if bias is not None else y

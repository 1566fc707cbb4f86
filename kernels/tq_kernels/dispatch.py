"""Pick the Triton kernel or the torch reference for a tensor's device.

CUDA tensors use Triton when it imports and launches; everything else (CPU, or a
CUDA machine where Triton is broken) uses the reference, and the caller is told which
via `backend_for`, so a slow fallback is never silent.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from tq_kernels import reference


@functools.lru_cache(maxsize=1)
def _triton() -> ModuleType | None:
    try:
        from tq_kernels import triton_kernels
    except Exception:  # Triton missing or unable to initialise: the reference runs
        return None
    return triton_kernels


def triton_available() -> bool:
    return _triton() is not None


def backend_for(device: torch.device | str) -> str:
    """'triton' or 'torch': what `grouped_matmul` and `rotate` run on that device."""
    dev = torch.device(device)
    if os.environ.get("TQ_FORCE_REFERENCE"):
        return "torch"
    if dev.type == "cuda" and _triton() is not None:
        return "triton"
    return "torch"


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   codebook: torch.Tensor, *, bits: int, group_size: int, out_features: int,
                   in_features: int) -> torch.Tensor:
    impl = _triton() if backend_for(x.device) == "triton" and bits in (2, 3, 4, 8) else None
    fn = impl.grouped_matmul if impl is not None else reference.grouped_matmul
    return fn(x, codes, scales, codebook, bits=bits, group_size=group_size,
              out_features=out_features, in_features=in_features)


def rotate(x: torch.Tensor, material: reference.Material, block: int) -> torch.Tensor:
    impl = _triton() if backend_for(x.device) == "triton" else None
    fn = impl.rotate if impl is not None else reference.rotate
    return fn(x, material, block)

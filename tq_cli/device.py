"""Where tq computes: one rule for convert, calibrate, search-seed, eval, bench and load."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Annotated

import torch
from pydantic import BeforeValidator

from tq_cli.errors import UnsupportedError


def check_device(device: object) -> str | torch.device | None:
    """`device` if tq can run on it (None, "auto", cpu, cuda, cuda:N or such a
    torch.device), else ValueError naming what to use; CUDA's presence is checked by
    `resolve_device`."""
    if device is None:
        return None
    if device == "auto":
        return "auto"
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{device!r} is not one tq runs on; use cpu, cuda (or cuda:N) "
                         "or auto")
    return device if isinstance(device, str) else dev


def _device_name(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not one tq runs on; use cpu, cuda (or cuda:N) or auto")
    check_device(value)
    return value


# A device as every spec (and so every command's --device) takes it: the rule of
# `check_device`, the same as `tq_cli.load`'s, given as a name.
Device = Annotated[str, BeforeValidator(_device_name)]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None) picks CUDA when there is one, else the CPU; "cuda" without a
    CUDA device is an error that says what to pass instead."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_device(device)
    except ValueError as e:
        raise UnsupportedError(f"device {e}") from None
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError("device 'cuda' was asked for, but no CUDA device is "
                               "available; use device cpu or auto")
    return dev


@functools.cache
def _libc_trim() -> object | None:
    """glibc's malloc_trim, or None (another C library, another OS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the OS (glibc's `malloc_trim(0)`, which
    also releases whole free pages inside its arenas). Between the blocks of a
    conversion the freed activations, Hessians and fit buffers of the last block
    otherwise stay resident in the arenas of the threads that made them, and the
    resident set creeps up with depth. A no-op where there is no glibc."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]

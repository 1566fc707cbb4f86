"""Where tq computes: one rule for convert, calibrate, search-seed, eval, bench and load."""

from __future__ import annotations

from typing import Literal

import torch

from tq_cli.errors import UnsupportedError

Device = Literal["auto", "cpu", "cuda"]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None) picks CUDA when there is one, else the CPU; "cuda" without a
    CUDA device is an error that says what to pass instead."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError("device 'cuda' was asked for, but no CUDA device is "
                               "available; use device cpu or auto")
    return dev

"""tq: convert language models into low-bit TurboQuant checkpoints and run them.

Library API (the CLI is a thin layer over these):
    convert(source, out, spec)        stream a model folder into a format-v1 checkpoint
    quantize(weight, spec, rotation)  -> QuantizedTensor (pure)
    dequantize(q)                     -> Tensor (pure)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "convert": "tq_cli.convert",
    "ConvertSpec": "tq_cli.convert",
    "quantize": "tq_cli.quantizer",
    "dequantize": "tq_cli.quantizer",
    "QuantizedTensor": "tq_cli.quantizer",
    "QuantSpec": "tq_cli.spec",
    "RotationSpec": "tq_cli.spec",
    "TqError": "tq_cli.errors",
}

if TYPE_CHECKING:
    from tq_cli.convert import ConvertSpec, convert
    from tq_cli.errors import TqError
    from tq_cli.quantizer import QuantizedTensor, dequantize, quantize
    from tq_cli.spec import QuantSpec, RotationSpec


def __getattr__(name: str) -> Any:
    # Lazy so `import tq_cli` stays cheap and never pulls torch-heavy modules until used.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tq_cli' has no attribute {name!r}")


__all__ = ["ConvertSpec", "QuantSpec", "QuantizedTensor", "RotationSpec", "TqError",
           "__version__", "convert", "dequantize", "quantize"]

"""`tq convert`: a model folder in, a tq checkpoint out (docs/format.md).

`converter` orchestrates; `spec` holds ConvertSpec/ConvertResult; `pipeline` streams
read+rotate, quantize and write in three threads; `finish` writes the manifest, index,
config and card and renames the folder into place; `mixed_precision` is --target-bits;
`flags` declares the quantization flags once for every command that takes them.
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "convert": "converter",
    "ConvertSpec": "spec",
    "ConvertResult": "spec",
})
__all__ = ["ConvertResult", "ConvertSpec", "convert"]

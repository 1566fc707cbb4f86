"""The math of tq, pure: no file I/O, no printing, no device juggling.

`spec` (QuantSpec, RotationSpec), `rotation` (rotation material from a seed, design.md
math 1), `codebook` (Lloyd-Max and uniform levels, math 3), `grouped` (grouped codebook
quantization: scales, refinement, outliers, math 2-6), `prepare` (column scales and
rotation before any fit, and `quantize`), `gptq` (the calibrated solver, math
7) and `choose` (one tensor: calibrated when a Hessian is there, data-free otherwise).
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "QuantSpec": "spec",
    "RotationSpec": "spec",
    "QuantizedTensor": "grouped",
    "quantize": "prepare",
    "dequantize": "grouped",
    "Rotation": "rotation",
    "make_rotation": "rotation",
})
__all__ = ["QuantSpec", "QuantizedTensor", "Rotation", "RotationSpec", "dequantize",
           "make_rotation", "quantize"]

"""Running a tq checkpoint: `loader` (tq_cli.load), `tq_linear` (TQLinear), the
transformers quantizer (`hf_quantizer`) and the generic transformers helpers
(`hf_models`) that calibration and evaluation use too.
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "load": "loader",
    "TQLinear": "tq_linear",
})
__all__ = ["TQLinear", "load"]

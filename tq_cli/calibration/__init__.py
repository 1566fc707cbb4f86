"""`tq calibrate` and `--synthetic-calib`: per-layer input second moments
H = E[x x^T] from running the original model, one block at a time.

`collect` runs the model (`skeleton` builds it block by block, `hessian` hooks the
inputs); `random_tokens` is the data-free variant that feeds it random vocabulary.
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "calibrate": "collect",
    "CalibSpec": "collect",
    "CalibResult": "collect",
})
__all__ = ["CalibResult", "CalibSpec", "calibrate"]

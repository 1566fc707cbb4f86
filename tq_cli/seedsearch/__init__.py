"""`tq search-seed`: grid search over rotation seeds per tensor.

`grid` scores each tensor's seeds, `ranges` parses the seed grid syntax, `distributed` splits the
work over ranks.
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "search": "grid",
    "SearchSpec": "grid",
})
__all__ = ["SearchSpec", "search"]

"""What a conversion will do before it does it: the recipe (which tensors, which
settings, from `recipes/*.toml`), the plan (every output key, dtype, shape, shard and
offset) and `prepare` (source -> recipe -> plan, shared by convert, calibrate and
search-seed).
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "Recipe": "recipe",
    "resolve_recipe": "recipe",
    "Plan": "plan",
    "make_plan": "plan",
})
__all__ = ["Plan", "Recipe", "make_plan", "resolve_recipe"]

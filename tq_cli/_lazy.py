"""Lazy package faces: a package's `__init__` names a few public names and the module
each lives in, and importing the package imports none of them until one is used (so
`import tq_cli` and `tq --help` never pay for torch or transformers)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_face(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `names[attr]` (a module path
    relative to the package) on first use."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

"""Recipes: per-model-family data that says which tensors are converted, and how.

A recipe is a TOML file, validated strictly: an unknown key is an error that names it.
The built-in ones ship as package data in `tq_cli/recipes/` and are read with
importlib.resources, so a wheel carries them; any other path works too. Rules are tried
in order and the first whose glob pattern matches a tensor name decides; a tensor no
rule matches is kept as it is.
"""

from __future__ import annotations

import fnmatch
import sys
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tq_cli.errors import RecipeError, first_error
from tq_cli.quant.spec import CodebookKind, QuantSpec

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Rule(_Strict):
    """One pattern and what to do with the tensors it matches."""

    pattern: str
    action: Literal["quantize", "keep"] = "quantize"
    bits: int | None = None
    group_size: int | None = None
    codebook: CodebookKind | None = None
    outliers: float | None = None

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def apply(self, base: QuantSpec) -> QuantSpec:
        """The base spec with this rule's overrides on top."""
        upd = {k: v for k, v in (("bits", self.bits), ("group_size", self.group_size),
                                 ("codebook", self.codebook), ("outliers", self.outliers))
               if v is not None}
        return QuantSpec(**{**base.model_dump(), **upd})


class Recipe(_Strict):
    """Which tensors a model family converts; recorded in the manifest."""

    name: str
    description: str = ""
    model_types: list[str] = Field(default_factory=list)
    rules: list[Rule]
    # A matching tensor that is not 2-D is kept (true) or refused (false).
    skip_non_2d: bool = False
    # Projections that read the same input (q/k/v, gate/up); calibration shares H.
    input_groups: list[list[str]] = Field(default_factory=list)

    def rule_for(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.matches(name)), None)


def builtin_recipes() -> dict[str, Traversable]:
    """The recipes shipped inside the package, by name (the file's stem)."""
    folder = files("tq_cli").joinpath("recipes")
    found = [p for p in folder.iterdir() if p.name.endswith(".toml")]
    return {p.name.removesuffix(".toml"): p for p in sorted(found, key=lambda p: p.name)}


def load_recipe(path: Path | Traversable) -> Recipe:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecipeError(f"{path}: cannot read recipe ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"{path.name}: not UTF-8 text (byte {e.start}); save the recipe as UTF-8") from e
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path.name}: not valid TOML ({e})") from e
    try:
        return Recipe(**data)
    except ValidationError as e:
        where, what = first_error(e)
        if e.errors()[0]["type"] == "extra_forbidden":
            raise RecipeError(f"{path.name}: unknown key '{where}'; check the spelling") from e
        raise RecipeError(f"{path.name}: invalid value at '{where}': {what}") from e


def resolve_recipe(name_or_path: str | None, config: dict | None) -> Recipe:
    """A recipe by name, by path, or (None) chosen from config.json's model_type."""
    builtins = builtin_recipes()
    if name_or_path is not None:
        p = Path(name_or_path)
        if p.suffix == ".toml" or p.is_file():
            if not p.is_file():
                raise RecipeError(f"{p}: no such recipe file")
            return load_recipe(p)
        if name_or_path not in builtins:
            raise RecipeError(
                f"unknown recipe '{name_or_path}'; built-in: {', '.join(sorted(builtins))}, "
                "or pass a path to a .toml file")
        return load_recipe(builtins[name_or_path])
    model_type = (config or {}).get("model_type")
    for path in builtins.values():
        r = load_recipe(path)
        if model_type and model_type in r.model_types:
            return r
    if "generic" not in builtins:
        raise RecipeError("the built-in recipes are missing (reinstall tq)")
    return load_recipe(builtins["generic"])

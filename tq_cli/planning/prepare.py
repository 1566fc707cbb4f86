"""Source -> recipe -> plan, once: what `tq convert`, `tq calibrate` and `tq search-seed`
all start with.

A folder or hub id is resolved and every shard header read (nothing is computed yet),
the recipe is resolved against its config, a SEEDS file (convert --seeds) is checked
against the source, and the plan is made; a source with nothing to convert is refused
here, in one place, with one message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tq_cli.errors import UnsupportedError
from tq_cli.io.safetensors_reader import SourceModel, open_source
from tq_cli.io.source import resolve_source
from tq_cli.planning.plan import Plan, make_plan
from tq_cli.planning.recipe import Recipe, resolve_recipe
from tq_cli.quant.spec import QuantSpec, RotationSpec


@dataclass
class PlannedSource:
    """A source with its recipe and plan: the input of every workflow that converts."""

    folder: Path
    model: SourceModel
    recipe: Recipe
    plan: Plan
    seeds: dict[str, int] | None = None  # tensor -> rotation seed (convert --seeds)
    seeds_record: dict[str, Any] | None = None  # what the manifest says of a SEEDS file
    max_shard_bytes: int = 2 * 1024**3

    @property
    def converted_names(self) -> list[str]:
        return [t.info.name for t in self.plan.converted]

    def replan(self, bits: dict[str, int]) -> Plan:
        """The same plan with a bit width per tensor (--target-bits)."""
        return make_plan(self.model, self.recipe, self.plan.quant, self.plan.rotation,
                         self.seeds, self.max_shard_bytes, bits=bits)


def plan_source(source: str | os.PathLike[str], recipe: str | None,
                quant: QuantSpec | None = None, rotation: RotationSpec | None = None, *,
                seeds: dict[str, int] | None = None,
                seeds_file: str | os.PathLike[str] | None = None,
                max_shard_bytes: int = 2 * 1024**3,
                model: SourceModel | None = None) -> PlannedSource:
    """Resolve SOURCE, its recipe and the plan; refuse a source with nothing to convert.
    `model`: SOURCE already opened (convert checks OUT between opening and planning)."""
    quant = quant or QuantSpec()
    rotation = rotation or RotationSpec()
    folder = resolve_source(source)
    model = model or open_source(folder)
    resolved = resolve_recipe(recipe, model.config)
    seeds_record = None
    if seeds_file is not None:
        from tq_cli.io.seeds import read_seeds

        seeds, seeds_record = read_seeds(seeds_file, model, rotation)
    plan = make_plan(model, resolved, quant, rotation, seeds, max_shard_bytes)
    if not plan.converted:
        raise UnsupportedError(
            f"{folder}: no tensor matches a quantize rule of recipe '{resolved.name}'; "
            "pass --recipe with one that fits this model")
    return PlannedSource(folder, model, resolved, plan, seeds, seeds_record, max_shard_bytes)

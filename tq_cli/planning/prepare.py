"""Source -> recipe -> plan, once: what `tq convert`, `tq calibrate` and `tq search-seed`
all start with.

A folder or hub id is resolved and every shard header read (nothing is computed yet),
the recipe is resolved against its config, a SEEDS file (convert --seeds) is checked
against the source, and the plan is made; a source with nothing to convert is refused
here, in one place, with one message.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tq_cli.errors import SourceError, UnsupportedError
from tq_cli.io.format import Expert
from tq_cli.io.safetensors_reader import FLOAT_DTYPES, SourceModel, open_source
from tq_cli.io.source import resolve_source
from tq_cli.planning.plan import HeadPlan, Plan, make_plan
from tq_cli.planning.recipe import Recipe, builtin_recipes, resolve_recipe
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
    modules: dict[str, str] = field(default_factory=dict)  # see make_plan
    keep: dict[str, str] = field(default_factory=dict)  # see make_plan
    experts: dict[str, Expert] = field(default_factory=dict)  # see make_plan
    head: HeadPlan | None = None  # see make_plan
    notes: list[str] = field(default_factory=list)  # what the user should hear about it
    check_seconds: float = 0.0  # spent asking transformers what it will build
    partial: bool = False  # not the whole model its config.json describes (--allow-partial)

    @property
    def converted_names(self) -> list[str]:
        """The converted tensors a recipe chose (not a head stored quantized: it gets the
        weight-only fit, tq_cli.quant.head)."""
        return [t.info.name for t in self.plan.converted if not t.head]

    def replan(self, bits: dict[str, int]) -> Plan:
        """The same plan with a bit width per tensor (--target-bits)."""
        return make_plan(self.model, self.recipe, self.plan.quant, self.plan.rotation,
                         self.seeds, self.max_shard_bytes, bits=bits, modules=self.modules,
                         keep=self.keep, experts=self.experts, head=self.head)


def plan_source(source: str | os.PathLike[str], recipe: str | None,
                quant: QuantSpec | None = None, rotation: RotationSpec | None = None, *,
                seeds: dict[str, int] | None = None,
                seeds_file: str | os.PathLike[str] | None = None,
                max_shard_bytes: int = 2 * 1024**3,
                model: SourceModel | None = None,
                check: bool = False, vision: bool = False,
                head_bits: int | None = None, head_required: bool = True,
                allow_partial: bool = False) -> PlannedSource:
    """Resolve SOURCE, its recipe and the plan; refuse a source with nothing to convert.
    `model`: SOURCE already opened (convert checks OUT between opening and planning).
    `check`: against the model transformers will build (what convert writes must load
    back; calibrate and search-seed write no checkpoint and skip its cost). `vision`: of an
    image-text-to-text model, convert the vision tower too (by default only its language
    model is converted; the projector is always kept). `head_bits`: store lm_head (and the
    input embedding tied to it) quantized at these bits (tq_cli.quant.head); needs `check`;
    a model whose head tq cannot store is refused when `head_required`, else keeps it.
    `allow_partial`: a source that is not the complete model its config.json describes is
    converted with a note instead of refused."""
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
    planned = PlannedSource(folder, model, resolved, plan, seeds, seeds_record,
                            max_shard_bytes)
    _say_kept(planned, {t.info.name: t.note for t in plan.tensors
                        if t.action == "keep" and t.note is not None})
    if recipe is not None and recipe not in builtin_recipes():
        # a user's recipe: a rule that matches nothing is most likely a typo in its pattern
        # (the built-in ones carry rules for several families at once)
        for rule in resolved.rules:
            if not any(rule.matches(name) for name in model.tensors):
                planned.notes.append(f"recipe '{resolved.name}': rule '{rule.pattern}' "
                                     "matches no tensor of this model; check its pattern")
    if head_bits is not None and not check:
        raise ValueError("plan_source: head_bits needs check=True")
    if check:
        t0 = time.perf_counter()
        _place(planned, builtin=recipe is None or recipe in builtin_recipes(), vision=vision,
               head_bits=head_bits, head_required=head_required, allow_partial=allow_partial)
        planned.check_seconds = time.perf_counter() - t0
    return planned


def _say_kept(planned: PlannedSource, kept: dict[str, str]) -> None:
    """One note per reason: how many tensors are kept that tq would convert, and their
    share of the weights (those converted and those kept for a reason)."""
    model = planned.model
    total = sum(t.info.numel for t in planned.plan.tensors
                if t.action != "keep" or t.note is not None or t.info.name in kept)
    for why in dict.fromkeys(kept.values()):
        names = [n for n, w in kept.items() if w == why]
        share = sum(model.tensors[n].numel for n in names) / max(total, 1)
        planned.notes.append(f"kept in full precision: {len(names)} tensor(s) "
                             f"({share:.0%} of the weights), such as '{names[0]}': {why}")


def _check_complete(planned: PlannedSource, skeleton: Any, allow_partial: bool) -> None:
    """The source holds exactly the model its config.json describes (tq_cli.runtime.
    source_check), or a one-line SourceError naming the file and the tensor (a note,
    with `allow_partial`)."""
    from tq_cli.runtime.source_check import source_mismatch

    found = source_mismatch(skeleton, planned.model.tensors)
    if found is None:
        return
    where = (planned.model.tensors[found.tensor].file if found.tensor is not None
             else planned.folder / "config.json")
    if allow_partial:
        planned.partial = True
        planned.notes.append(f"--allow-partial: {where}: {found.message.split('; ')[0]}; a "
                             "loader will refuse the checkpoint where it cannot fill that")
        return
    raise SourceError(f"{where}: {found.message} (--allow-partial converts it anyway)")


# What a VLM keeps by default, outside its language model (module_map.Placement.part).
POLICY = {"vision": "the vision tower of an image-text model; pass --vision to convert it too",
          "other": "outside the language model and the vision tower of an image-text model "
                   "(the projector)"}


def _place(planned: PlannedSource, builtin: bool, vision: bool,
           head_bits: int | None = None, head_required: bool = True,
           allow_partial: bool = False) -> None:
    """Check every converted tensor against the model transformers will build (tq_cli.
    runtime.module_map) and plan again with what that says: the module each runs as; the
    tensors tq could not load back or run, kept (a built-in recipe) or refused (the user's
    recipe asked for them by name); and, of a VLM, what is not its language model, kept
    unless asked for (`vision`); and, with `head_bits`, where the model's lm_head is."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        if head_bits is not None and head_required:
            raise UnsupportedError("--head-bits: finding the model's lm_head needs "
                                   "transformers: pip install 'tq[models]'")
        if head_bits is not None:
            planned.notes.append("lm_head not quantized (--head-bits): finding it needs "
                                 "transformers: pip install 'tq[models]'")
        planned.notes.append("transformers is not installed, so tq could not check that each "
                             "converted tensor loads back as an nn.Linear; pip install "
                             "'tq[models]' for the check")
        return
    from tq_cli.runtime.module_map import (
        NO_HEAD,
        build_in_folder,
        head_placement,
        place,
        unchecked_because,
    )

    model, plan = planned.model, planned.plan
    assert model.config is not None  # make_plan refuses a folder without one
    skipped = unchecked_because(model.config)
    if skipped:
        if head_bits is not None and head_required:
            raise UnsupportedError(f"{planned.folder}: --head-bits: tq cannot find the model's "
                                   f"lm_head ({skipped}); pass --head-bits none")
        if head_bits is not None:
            planned.notes.append(f"lm_head not quantized (--head-bits): tq cannot find it "
                                 f"({skipped})")
        planned.notes.append(f"not checked that each converted tensor loads back: {skipped}")
        return
    skeleton = build_in_folder(planned.folder, model.config)
    _check_complete(planned, skeleton, allow_partial)
    placed = place(skeleton, planned.converted_names)
    where = head_placement(skeleton, list(model.tensors)) if head_bits is not None else None
    if not isinstance(where, str) and where is not None:
        info = model.tensors[where.source]
        if len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
            where = (f"its tensor '{where.source}' has shape {list(info.shape)} and dtype "
                     f"{info.dtype}, and tq stores a 2-D float head only")
    if isinstance(where, str):
        if head_required:
            raise UnsupportedError(f"{planned.folder}: --head-bits {head_bits}: {where}; "
                                   "pass --head-bits none")
        if not where.endswith(NO_HEAD):  # a model with no head says nothing
            planned.notes.append(f"lm_head not quantized (--head-bits): {where}")
    elif where is not None and head_bits is not None:
        planned.head = HeadPlan(where.source, where.module, where.embedding, head_bits)
        placed.pop(where.source, None)  # the head's own rules, whatever the recipe says
    # A VLM's vision tower and projector first: kept by policy, whatever else they are.
    planned.keep = {n: POLICY[p.part] for n, p in placed.items()
                    if p.part in POLICY and not (vision and p.part == "vision")}
    cannot = {n: p.reason or "" for n, p in placed.items()
              if p.module is None and n not in planned.keep}
    if cannot and not builtin:
        name, why = next(iter(cannot.items()))
        more = f" (and {len(cannot) - 1} more)" if len(cannot) > 1 else ""
        raise UnsupportedError(
            f"{model.tensors[name].file.name}: tensor '{name}'{more} cannot run quantized "
            f"({why}); add a keep rule for it to recipe '{planned.recipe.name}'")
    planned.keep |= cannot
    planned.modules = {n: p.module for n, p in placed.items()
                       if p.module is not None and n not in planned.keep
                       and p.module != n.removesuffix(".weight")}
    planned.experts = {n: p.expert for n, p in placed.items()
                       if p.expert is not None and n not in planned.keep}
    _say_kept(planned, planned.keep)
    if planned.keep or planned.modules or planned.experts or planned.head:
        planned.plan = make_plan(model, planned.recipe, plan.quant, plan.rotation,
                                 planned.seeds, planned.max_shard_bytes,
                                 modules=planned.modules, keep=planned.keep,
                                 experts=planned.experts, head=planned.head)
        if not any(not t.head for t in planned.plan.converted):  # a head alone is not it
            if not planned.keep:  # the recipe converts the head only, which is --head-bits'
                raise UnsupportedError(
                    f"{planned.folder}: recipe '{planned.recipe.name}' converts only the "
                    "model's lm_head, which --head-bits stores; use a recipe that converts "
                    "the model's layers")
            raise UnsupportedError(
                f"{planned.folder}: none of the tensors recipe '{planned.recipe.name}' "
                f"converts can run quantized ({next(iter(planned.keep.values()))}); tq runs "
                "converted nn.Linear layers only")

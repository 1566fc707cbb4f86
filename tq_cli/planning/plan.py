"""The conversion plan: per tensor keep or quantize, with what spec, stored under which keys.

Built from the validated headers, the recipe and the CLI's specs before any compute,
so everything that cannot work is refused up front, and the output layout (every key,
dtype, shape and offset) is fixed. The plan's hash ties a partial output to it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from tq_cli.errors import RecipeError, UnsupportedError, first_error
from tq_cli.io.format import (
    CONVERTED,
    GUARD_DTYPE,
    GUARD_SHAPE,
    Expert,
    rotation_key,
    storage_layout,
    stored_key,
    version_for,
)
from tq_cli.io.safetensors_reader import FLOAT_DTYPES, SourceModel, TensorInfo
from tq_cli.io.writer import Layout, plan_layout
from tq_cli.planning.recipe import Recipe
from tq_cli.quant.head import head_rotation, head_spec
from tq_cli.quant.rotation import material_layout, resolve_block, rotation_id
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.version import __version__

Key = tuple[str, str, tuple[int, ...]]
# Embedding tables by the names transformers gives them; they are nn.Embedding, not
# nn.Linear, so a converted one could never be loaded.
def _embedding_or_head(t: TensorPlan) -> bool:
    parts = t.info.name.split(".")
    return t.head or bool(EMBEDDING.search(t.info.name)) or (
        len(parts) > 1 and parts[-2] in ("lm_head", "output", "embed_out"))


EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_positions|word_embeddings|position_embeddings"
                       r"|token_type_embeddings|wte|wpe|shared|embeddings)(\.|$)")


@dataclass(frozen=True)
class HeadPlan:
    """lm_head stored quantized (tq_cli.quant.head): its source tensor, the module it runs
    as where that is not `X` of `X.weight`, and the input embedding tied to it."""

    name: str
    module: str | None
    embedding: str | None
    bits: int


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one source tensor."""

    info: TensorInfo
    action: str  # CONVERTED ("quantize") | "keep"
    quant: QuantSpec | None = None
    rotation: RotationSpec | None = None
    block: int = 0
    rotation_id: str | None = None
    keys: tuple[Key, ...] = ()
    module: str | None = None  # converted: the nn.Linear it runs as, when not `X` of `X.weight`
    expert: Expert | None = None  # converted: one expert's projection of a MoE layer
    note: str | None = None  # kept although the recipe converts it: why
    head: bool = False  # converted: the model's lm_head (HeadPlan), weight-only fit
    embedding: str | None = None  # converted head: the input embedding tied to it


@dataclass(frozen=True)
class RotationPlan:
    """Material shared by every tensor with the same kind, input size, block and seed."""

    rotation_id: str
    spec: RotationSpec
    n: int
    block: int
    keys: tuple[Key, ...]
    users: int


@dataclass
class Plan:
    source: SourceModel
    recipe: Recipe
    quant: QuantSpec
    rotation: RotationSpec
    tensors: list[TensorPlan]
    rotations: dict[str, RotationPlan]
    layout: Layout = field(default_factory=Layout)
    extra: dict = field(default_factory=dict)  # calibration and mixed precision, hashed too
    # An empty U8 tensor under the first converted weight's own name. tq never reads it;
    # transformers without tq's quantizer finds it where a [out, in] weight should be and
    # refuses to load ("size mismatch"), instead of running random layers in its place.
    guard: str | None = None

    @property
    def converted(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.action == CONVERTED]

    def quantized_share(self) -> tuple[float, float]:
        """(stored quantized, of all the source's weights; the same of its non-embedding
        weights): elements of weight matrices (2-D and up), the embedding tables and the
        head counted in the first figure only."""
        weights = [t for t in self.tensors if len(t.info.shape) >= 2]
        body = [t for t in weights if not _embedding_or_head(t)]

        def share(ts: list[TensorPlan]) -> float:
            total = sum(t.info.numel for t in ts)
            done = sum(t.info.numel for t in ts if t.action == CONVERTED)
            return done / total if total else 0.0

        return share(weights), share(body)

    def largest_kept(self, k: int = 3) -> list[TensorPlan]:
        """The k largest non-embedding weights kept in full precision."""
        kept = [t for t in self.tensors if len(t.info.shape) >= 2 and t.action != CONVERTED
                and not _embedding_or_head(t)]
        return sorted(kept, key=lambda t: -t.info.numel)[:k]

    @property
    def format_version(self) -> int:
        """The format version the checkpoint is written in (tq_cli.io.format.version_for)."""
        return version_for(any(t.embedding is not None for t in self.tensors))

    def hash(self) -> str:
        desc = {
            "tq": __version__, "format": self.format_version,
            "source": self.source.fingerprint,
            "recipe": self.recipe.model_dump(), "quant": self.quant.model_dump(),
            "rotation": self.rotation.model_dump(),
            "tensors": [[t.info.name, t.action, t.quant.model_dump() if t.quant else None,
                         t.rotation_id, t.module]
                        + ([t.embedding, "head"] if t.head else []) for t in self.tensors],
            "layout": self.layout.describe(),
        }
        if self.extra:
            desc["extra"] = self.extra
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def make_plan(source: SourceModel, recipe: Recipe, quant: QuantSpec, rotation: RotationSpec,
              seeds: dict[str, int] | None = None,
              max_shard_bytes: int = 2 * 1024**3,
              bits: dict[str, int] | None = None,
              modules: Mapping[str, str] | None = None,
              keep: Mapping[str, str] | None = None,
              experts: Mapping[str, Expert] | None = None,
              head: HeadPlan | None = None) -> Plan:
    """Decide every tensor's fate and the output layout; raises on anything unworkable.

    From what transformers will build (tq_cli.planning.prepare): `modules` names the
    nn.Linear a converted tensor runs as where that is not `X` of `X.weight`; `keep`
    holds the tensors the recipe converts that tq could not run, with the reason;
    `experts` the converted tensors that are one expert's projection of a MoE layer;
    `head` the lm_head, when it is stored quantized."""
    qc = (source.config or {}).get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise UnsupportedError(
            f"{source.folder / 'config.json'}: the model is already quantized "
            f"(quant_method '{method}'); convert the original weights")
    if not isinstance(source.config, dict) or not source.config.get("model_type"):
        raise UnsupportedError(
            f"{source.folder}: no config.json with a model_type; a tq checkpoint is loaded "
            "from its config, so add the model's config.json to the folder")
    if not isinstance(source.config["model_type"], str):
        raise UnsupportedError(
            f"{source.folder / 'config.json'}: model_type is "
            f"{type(source.config['model_type']).__name__} "
            f"{source.config['model_type']!r}, not a name; transformers could not load the "
            "checkpoint, so fix config.json (e.g. \"model_type\": \"llama\")")
    tensors: list[TensorPlan] = []
    rotations: dict[str, RotationPlan] = {}
    users: dict[str, int] = {}
    for info in source.tensors.values():
        is_head = head is not None and info.name == head.name
        if head is not None and is_head:
            if len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
                raise UnsupportedError(
                    f"{info.file.name}: tensor '{info.name}' is the model's lm_head but has "
                    f"shape {list(info.shape)} and dtype {info.dtype}; tq stores a 2-D float "
                    "head quantized only: pass --head-bits none")
            spec, rot, expert = head_spec(head.bits), head_rotation(rotation.seed), None
        else:
            rule = recipe.rule_for(info.name)
            if rule is None or rule.action == "keep" or info.numel == 0:
                tensors.append(TensorPlan(info, "keep", keys=((info.name, info.dtype, info.shape),),
                                          note=None if rule else _fused_experts(info)))
                continue
            if len(info.shape) != 2:
                if recipe.skip_non_2d:
                    tensors.append(TensorPlan(info, "keep",
                                              keys=((info.name, info.dtype, info.shape),),
                                              note=_fused_experts(info)))
                    continue
                raise UnsupportedError(
                    f"{info.file.name}: tensor '{info.name}' has shape {list(info.shape)}, but "
                    f"recipe '{recipe.name}' converts it and only 2-D weights can be; "
                    "add a keep rule for it")
            if info.dtype not in FLOAT_DTYPES:
                raise UnsupportedError(
                    f"{info.file.name}: tensor '{info.name}' has dtype {info.dtype}, which tq "
                    f"cannot quantize (only {', '.join(sorted(FLOAT_DTYPES))}); "
                    "add a keep rule for it to the recipe")
            if EMBEDDING.search(info.name):
                raise UnsupportedError(
                    f"{info.file.name}: tensor '{info.name}' is an embedding table, but recipe "
                    f"'{recipe.name}' converts it and tq runs converted nn.Linear layers only; "
                    "add a keep rule for it")
            try:
                spec = rule.apply(quant)
            except ValidationError as e:
                _, msg = first_error(e)
                raise RecipeError(
                    f"recipe '{recipe.name}': rule '{rule.pattern}' (matching '{info.name}') "
                    f"gives invalid settings: {msg}") from e
            if keep and info.name in keep:
                tensors.append(TensorPlan(info, "keep", keys=((info.name, info.dtype, info.shape),),
                                          note=keep[info.name]))
                continue
            if bits and info.name in bits:
                spec = spec.model_copy(update={"bits": bits[info.name]})
            expert = (experts or {}).get(info.name)
            if expert is not None and spec.col_scale != "none":
                # A layer's experts read one routed input, rotated once for all of them
                # (tq_cli.runtime.experts, the vLLM MoE op): no per-expert column scales.
                spec = spec.model_copy(update={"col_scale": "none"})
            rot = rotation
            if seeds and info.name in seeds:
                rot = RotationSpec(kind=rotation.kind, block=rotation.block, seed=seeds[info.name])
        out, n = info.shape
        try:
            block = resolve_block(rot, spec.group_size)
        except UnsupportedError as e:
            raise UnsupportedError(f"tensor '{info.name}': {e}") from e
        rid = None
        if rot.kind != "none":
            rid = rotation_id(rot.kind, n, block, rot.seed)
            users[rid] = users.get(rid, 0) + 1
            if rid not in rotations:
                mat = tuple((rotation_key(rid, suffix), dt, tuple(shape))
                            for suffix, (dt, shape) in material_layout(rot.kind, n, block).items())
                rotations[rid] = RotationPlan(rid, rot, n, block, mat, 0)
        keys = tuple((stored_key(info.name, suffix), dt, tuple(shape))
                     for suffix, (dt, shape) in storage_layout(out, n, spec).items())
        module = head.module if head is not None and is_head else (modules or {}).get(info.name)
        if module == info.name.removesuffix(".weight"):
            module = None
        tensors.append(TensorPlan(info, CONVERTED, spec, rot, block, rid, keys, module,
                                  expert=expert, head=is_head,
                                  embedding=head.embedding if head is not None and is_head
                                  else None))
    rotations = {rid: RotationPlan(r.rotation_id, r.spec, r.n, r.block, r.keys, users[rid])
                 for rid, r in rotations.items()}
    # The guard sits under a converted weight's name; not an expert's, whose name a
    # transformers converter would try to merge with the other experts'.
    converted = [t for t in tensors if t.action == CONVERTED]
    guard = next((t.info.name for t in converted if t.expert is None and not t.head),
                 converted[0].info.name if converted else None)
    _check_collisions(source, tensors, rotations)
    plan = Plan(source, recipe, quant, rotation, tensors, rotations, guard=guard)
    groups = [list(r.keys) for r in rotations.values()] + [list(t.keys) for t in tensors]
    if guard is not None:
        groups.append([(guard, GUARD_DTYPE, GUARD_SHAPE)])
    plan.layout = plan_layout(groups, max_shard_bytes,
                              metadata={"tq_format_version": str(plan.format_version)})
    return plan


def _fused_experts(info: TensorInfo) -> str | None:
    """Why a MoE's experts stored as one 3-D tensor (gpt-oss) stay in full precision."""
    if len(info.shape) == 3 and "expert" in info.name and info.dtype in FLOAT_DTYPES:
        return ("a MoE's experts stored as one 3-D tensor; tq converts experts stored one by "
                "one (2-D)")
    return None


def _check_collisions(source: SourceModel, tensors: list[TensorPlan],
                      rotations: dict[str, RotationPlan]) -> None:
    """Every key tq writes is written once: a source tensor named like one of tq's own
    keys (`X.weight.codes`, `tq.rotation.*`) is refused before anything is written."""
    owner: dict[str, str] = {}
    claims = [(k, tp.info.name) for tp in tensors for k, _, _ in tp.keys]
    claims += [(k, f"rotation {rid}") for rid, r in rotations.items() for k, _, _ in r.keys]
    for key, who in claims:
        if key in owner:
            # The offender is the source tensor named like the key; the other wrote it.
            first, second = (owner[key], who) if owner[key] == key else (who, owner[key])
            info = source.tensors.get(first)
            where = f"{info.file.name}: " if info is not None else ""
            raise UnsupportedError(
                f"{where}tensor '{first}' has the name of a key tq writes for '{second}'; "
                "tq cannot convert this folder as it is: rename that tensor, or keep the "
                f"tensor '{second}' with a keep rule")
        owner[key] = who

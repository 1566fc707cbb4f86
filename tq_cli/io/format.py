"""The checkpoint format (version 3), defined once: what a tq folder stores, under which
names.

Every writer and reader of a checkpoint asks this module instead of spelling the format
itself (docs/format.md describes it for people):

- `FORMAT_VERSION`, `QUANT_METHOD` (config.json's `quantization_config.quant_method`)
  and `MANIFEST`, the manifest's file name;
- the stored tensors of a converted weight `X.weight`: `SUFFIXES` (and `COL_SCALE`
  where its spec scales columns; `ALL_SUFFIXES` names both), their keys
  (`stored_key`: `X.weight.codes`, ...), and their dtypes and shapes, known from the
  weight's shape and spec before any compute (`storage_layout`; the byte layout of a
  packed row is tq_kernels.packing's);
- the guard: an empty `GUARD_DTYPE` tensor stored under the first converted weight's own
  name, so that transformers without tq refuses the folder instead of running random
  layers; `GUARD` is its entry in the conversion journal;
- the key prefix of the shared rotation material (`ROTATION_PREFIX`, `rotation_key`);
- `converted_entries`: the one reader of the manifest's converted tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from tq_cli.errors import TqError, first_error
from tq_cli.quant.grouped import QuantizedTensor, group_count, outlier_count

# Rotation.tensors() builds the material's keys inside tq_cli.quant, which may not import
# tq_cli.io, so the prefix is defined there and named here for every other reader.
from tq_cli.quant.rotation import ROTATION_PREFIX
from tq_cli.quant.spec import QuantSpec
from tq_kernels.packing import packed_row_bytes

# 2: a converted weight may store column scales (`COL_SCALE`); version 1 folders (none
# do) read as before, and a reader of version 1 refuses a version 2 folder by name.
# 3: a converted lm_head may also be the model's input embedding (`ConvertedEntry.
# embedding`: a tied head stored once, quantized). A conversion writes the lowest version
# that describes its folder (`version_for`), so folders without one stay version 2.
FORMAT_VERSION = 3
TIED_HEAD_VERSION = 3
QUANT_METHOD = "turboquant"
MANIFEST = "tq_manifest.json"

# The stored tensors of one converted weight, in storage order; each is the
# QuantizedTensor field of the same name.
SUFFIXES = ("codes", "scales", "codebook", "outlier_idx", "outlier_val")
# Stored only where the spec's col_scale is not "none": t, x is scaled by before rotation.
COL_SCALE = "col_scale"
ALL_SUFFIXES = (*SUFFIXES, COL_SCALE)

GUARD = "tq.guard"  # the guard's entry in the conversion journal (not a stored key)
GUARD_DTYPE = "U8"
GUARD_SHAPE = (0,)

CONVERTED = "quantize"  # a manifest entry's `action` for a converted weight

__all__ = ["ALL_SUFFIXES", "COL_SCALE", "CONVERTED", "FORMAT_VERSION", "GUARD", "GUARD_DTYPE",
           "GUARD_SHAPE", "MANIFEST",
           "QUANT_METHOD", "ROLES", "ROTATION_PREFIX", "SUFFIXES", "ConvertedEntry", "Expert",
           "check_format_version", "converted_entries", "rotation_key", "storage_layout",
           "stored_key", "stored_tensors", "version_for"]


def stored_key(weight: str, suffix: str) -> str:
    """The key of one stored tensor of converted weight `weight`: `X.weight.codes`."""
    return f"{weight}.{suffix}"


def rotation_key(rotation_id: str, suffix: str) -> str:
    """The key of one tensor of shared rotation material: `tq.rotation.<id>.signs`."""
    return f"{ROTATION_PREFIX}{rotation_id}.{suffix}"


def storage_layout(out: int, n: int, spec: QuantSpec) -> dict[str, tuple[str, list[int]]]:
    """suffix -> (safetensors dtype, shape) of the stored tensors of a converted [out, n]
    weight, known before any compute."""
    k = outlier_count(out * n, spec.outliers)
    layout = {
        "codes": ("U8", [out, packed_row_bytes(n, spec.bits)]),
        "scales": ("F16", [out, group_count(n, spec.group_size)]),
        "codebook": ("F32", [1 << spec.bits]),
        "outlier_idx": ("I32", [k]),
        "outlier_val": ("F16", [k]),
    }
    if spec.col_scale != "none":
        layout[COL_SCALE] = ("F16", [n])
    return layout


def stored_tensors(weight: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """key -> tensor of what the format stores for converted weight `weight` (the rotation
    material is stored once per rotation, apart)."""
    if (q.spec.col_scale != "none") != (q.col_scale is not None):
        raise ValueError(f"'{weight}': spec col_scale '{q.spec.col_scale}' does not match "
                         "the column scales the fit returned")
    suffixes = (*SUFFIXES, COL_SCALE) if q.col_scale is not None else SUFFIXES
    return {stored_key(weight, s): getattr(q, s) for s in suffixes}


def version_for(tied_head: bool) -> int:
    """The format version a conversion writes: 3 where a converted head is also the input
    embedding (only a version 3 reader loads that), 2 otherwise."""
    return TIED_HEAD_VERSION if tied_head else 2


def check_format_version(where: str | Path, version: int) -> None:
    """Refuse, by name, a checkpoint written in a format newer than this tq reads."""
    if version > FORMAT_VERSION:
        raise TqError(f"{where}: format version {version} is newer than this tq reads "
                      f"({FORMAT_VERSION}); upgrade tq")


@dataclass(frozen=True)
class Expert:
    """A converted weight that is one expert's projection in a mixture-of-experts layer:
    transformers fuses the experts into 3-D parameters of module `of`, tq runs them per
    expert (tq_cli.runtime.experts)."""

    of: str  # the experts module's path in the built model
    index: int  # the expert's number
    role: str  # "gate", "up" or "down"

    def record(self) -> dict[str, Any]:
        return {"of": self.of, "index": self.index, "role": self.role}


ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class ConvertedEntry:
    """One converted weight as the manifest records it."""

    name: str  # the source weight's name, `X.weight`
    shape: tuple[int, int]  # [out, in]
    spec: QuantSpec
    rotation_kind: str  # "hadamard" | "orthogonal" | "none"
    block: int
    seed: int
    rotation_id: str | None  # the shared material's id; None for "none"
    rel_error: float | None
    # The nn.Linear it runs as in the model transformers builds, where the loader renames
    # it (a VLM's language model); None: `X` of `X.weight`.
    placed: str | None = None
    expert: Expert | None = None  # one expert of a mixture-of-experts layer
    # A converted lm_head tied to the input embedding (format version 3): the embedding
    # module's path in the built model, which reads its rows from this weight.
    embedding: str | None = None

    @property
    def module(self) -> str:
        """The linear layer's name in the built model (`X` of `X.weight` unless renamed)."""
        return self.placed or self.name.removesuffix(".weight")

    @property
    def keys(self) -> dict[str, str]:
        """suffix -> key of each stored tensor."""
        return {s: stored_key(self.name, s)
                for s in storage_layout(self.shape[0], self.shape[1], self.spec)}

    def storage(self) -> dict[str, tuple[str, list[int]]]:
        """key -> (safetensors dtype, shape) of each stored tensor."""
        return {stored_key(self.name, s): layout for s, layout in
                storage_layout(self.shape[0], self.shape[1], self.spec).items()}


def _converted(e: Mapping[str, Any]) -> ConvertedEntry:
    name, shape, spec, rot = e.get("name"), e.get("shape"), e.get("spec"), e.get("rotation")
    if (not isinstance(name, str) or not isinstance(spec, Mapping)
            or not isinstance(rot, Mapping) or not isinstance(shape, list | tuple)
            or len(shape) != 2):
        raise ValueError(f"converted tensor '{name}' has no spec, no rotation or a shape "
                         "that is not 2-D")
    try:
        # Format version 1 had no column scales: its specs lack the field.
        qs = QuantSpec.model_validate({"col_scale": "none", **spec})
    except ValidationError as err:
        where, what = first_error(err)
        raise ValueError(f"converted tensor '{name}' has an invalid spec at '{where}': "
                         f"{what}") from None
    kind, block, seed, rid = (rot.get(k) for k in ("kind", "block", "seed", "id"))
    if (not isinstance(kind, str) or not isinstance(block, int) or not isinstance(seed, int)
            or not (rid is None or isinstance(rid, str))
            or not all(isinstance(d, int) for d in shape)):
        raise ValueError(f"converted tensor '{name}' has a rotation or shape that is not "
                         "the format's")
    rel, placed = e.get("rel_error"), e.get("module")
    if not (placed is None or isinstance(placed, str)):
        raise ValueError(f"converted tensor '{name}' has a module that is not a name")
    expert = _expert(name, e.get("expert"))
    embedding = e.get("embedding")
    if not (embedding is None or isinstance(embedding, str)) or (
            embedding is not None and (expert is not None or kind != "hadamard")):
        raise ValueError(f"converted tensor '{name}' has an embedding that is not a name of "
                         "a Hadamard-rotated head")
    return ConvertedEntry(name=name, shape=(shape[0], shape[1]), spec=qs, rotation_kind=kind,
                          block=block, seed=seed, rotation_id=rid,
                          rel_error=float(rel) if isinstance(rel, int | float) else None,
                          placed=placed, expert=expert, embedding=embedding)


def _expert(name: str, record: Any) -> Expert | None:
    if record is None:
        return None
    if not isinstance(record, Mapping):
        raise ValueError(f"converted tensor '{name}' has an expert record that is not a map")
    of, index, role = record.get("of"), record.get("index"), record.get("role")
    if (not isinstance(of, str) or not isinstance(index, int) or isinstance(index, bool)
            or index < 0 or role not in ROLES):
        raise ValueError(f"converted tensor '{name}' has an expert record that is not "
                         "the format's (of, index, role)")
    return Expert(of, index, role)


def converted_entries(manifest: Mapping[str, Any]) -> list[ConvertedEntry]:
    """Every converted weight of a manifest, in manifest order, and nothing else.

    Raises TqError for a newer format version, and ValueError naming the first converted
    entry that lacks what the format needs; readers that name the file wrap it
    (tq_cli.io.integrity does, before any other reader sees the manifest)."""
    version = manifest.get("format_version")
    if isinstance(version, int):
        check_format_version(MANIFEST, version)
    tensors = manifest.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError("the manifest has no list of tensors")
    return [_converted(e) for e in tensors
            if isinstance(e, Mapping) and e.get("action") == CONVERTED]

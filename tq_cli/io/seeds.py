"""The SEEDS file of `tq search-seed`, read for `tq convert --seeds`.

`tq_cli.seedsearch.grid` writes it; this module validates it with a schema (every field
the reader uses, seeds as whole numbers a rotation accepts) and checks it against the
source model and rotation, so a damaged or foreign file is a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from tq_cli.errors import SeedSearchError, first_error
from tq_cli.io.safetensors_reader import SourceModel
from tq_cli.quant.spec import MAX_SEED, RotationSpec

SEEDS_FORMAT = 1


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _SeedEntry(_Loose):
    seed: StrictInt = Field(ge=0, le=MAX_SEED)


class _Source(_Loose):
    name: str
    fingerprint: str


class _Rotation(_Loose):
    kind: str


class SeedsDoc(_Loose):
    """The fields of a SEEDS file that `convert --seeds` relies on."""

    tq_seeds: int
    source: _Source
    rotation: _Rotation
    objective: str
    per: str
    quant: dict[str, Any]
    seeds_searched: list[StrictInt]
    tensors: dict[str, _SeedEntry]


def read_seeds(path: str | os.PathLike[str], source: SourceModel,
               rotation: RotationSpec) -> tuple[dict[str, int], dict[str, Any]]:
    """Load a SEEDS file for `convert --seeds`, refusing one made for another model or
    rotation; returns tensor -> seed and what the manifest records about the file."""
    p = Path(path).expanduser()
    how = "make one with tq search-seed"
    try:
        raw = p.read_bytes()
        data = json.loads(raw)
    except FileNotFoundError:
        raise SeedSearchError(f"{p}: no such seeds file; {how}") from None
    except IsADirectoryError:
        raise SeedSearchError(f"{p}: is a folder, not a seeds file; {how}") from None
    except (ValueError, RecursionError):
        raise SeedSearchError(f"{p}: not a JSON seeds file; {how}") from None
    if not isinstance(data, dict) or data.get("tq_seeds") != SEEDS_FORMAT:
        raise SeedSearchError(f"{p}: not a tq search-seed result (format "
                              f"{data.get('tq_seeds') if isinstance(data, dict) else '?'}); "
                              f"{how}")
    try:
        doc = SeedsDoc.model_validate(data)
    except ValidationError as e:
        where, what = first_error(e)
        raise SeedSearchError(f"{p}: invalid seeds file at '{where}': {what}; {how}") from None
    if doc.source.fingerprint != source.fingerprint:
        raise SeedSearchError(
            f"{p}: seeds were searched for model '{doc.source.name}', not for "
            f"'{source.folder.name}' (fingerprints differ); run tq search-seed on "
            f"{source.folder}")
    if doc.rotation.kind != rotation.kind:
        raise SeedSearchError(
            f"{p}: seeds were searched for --rotation {doc.rotation.kind}, but this "
            f"conversion uses --rotation {rotation.kind}; pass --rotation "
            f"{doc.rotation.kind} or search again")
    seeds = {name: entry.seed for name, entry in doc.tensors.items()}
    unknown = sorted(set(seeds) - set(source.tensors))
    if unknown:
        raise SeedSearchError(f"{p}: tensor '{unknown[0]}' is not in {source.folder}; the "
                              "seeds file belongs to another model")
    record = {"file": p.name, "sha256": hashlib.sha256(raw).hexdigest(),
              "objective": doc.objective, "per": doc.per,
              "quant": doc.quant, "searched": len(doc.seeds_searched)}
    return seeds, record

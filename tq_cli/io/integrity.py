"""Is a tq folder exactly what `tq convert` wrote? Checked before any tensor is read.

A checkpoint is a deployment artifact: it must load as written or refuse to load,
naming what is wrong. `verify_checkpoint` checks, in order and reading only JSON and
safetensors headers:

1. the manifest against a schema (every field a reader relies on, with its type);
2. the manifest's digest against the one `convert` recorded in config.json's
   `quantization_config.manifest_sha256` (the manifest minus its `eval` results, which
   `tq eval --write-card` appends later), and config.json's (without its
   quantization_config) against the `config_sha256` the manifest records;
3. the storage the manifest implies (each converted tensor's codes, scales, codebook and
   outliers follow from its bits, group size and shape; each rotation's material from
   its kind, width and block) against the index's `weight_map` and every shard's header:
   the same keys, in the same shards, with the same dtypes and shapes, and nothing else;
4. optionally the sha256 of every shard (a full read).

An edited bits, group size, block, rotation id or action, a deleted entry, an extra
shard or a redirected index entry all break step 3 or 2, so they cannot load silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from tq_cli.errors import CorruptFileError, first_error
from tq_cli.io.format import (
    GUARD_DTYPE,
    GUARD_SHAPE,
    MANIFEST,
    QUANT_METHOD,
    converted_entries,
    rotation_key,
)
from tq_cli.io.manifest import loads_strict
from tq_cli.io.safetensors_reader import DTYPES, INDEX_NAME, read_header
from tq_cli.io.writer import file_sha256
from tq_cli.quant.rotation import material_layout, rotation_id
from tq_cli.quant.spec import MAX_SEED, QuantSpec

HOW = "the checkpoint was altered or damaged; convert again or re-download it"


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _TensorRotation(_Loose):
    kind: Literal["hadamard", "orthogonal", "none"]
    block: StrictInt = Field(ge=1)
    seed: StrictInt = Field(ge=0, le=MAX_SEED)
    id: str | None


class _Tensor(_Loose):
    name: str
    shape: list[StrictInt]
    dtype: str
    action: Literal["quantize", "keep"]
    keys: list[str]
    shards: list[str]
    spec: QuantSpec | None = None
    rotation: _TensorRotation | None = None
    # What readers act on besides the storage: the module a converted tensor runs as, a
    # head and the input embedding it is stored for, how it was fitted and its errors.
    module: str | None = None
    head: StrictBool | None = None
    embedding: str | None = None
    fit: Literal["gptq", "weight-only"] | None = None
    calibrated: StrictBool | None = None
    rel_error: float | None = Field(None, ge=0, allow_inf_nan=False)
    weighted_rel_error: float | None = Field(None, ge=0, allow_inf_nan=False)
    bits_per_weight: float | None = Field(None, gt=0, allow_inf_nan=False)


class _Rotation(_Loose):
    kind: Literal["hadamard", "orthogonal"]
    n: StrictInt = Field(ge=1)
    block: StrictInt = Field(ge=1)
    seed: StrictInt = Field(ge=0, le=MAX_SEED)
    keys: list[str]


class ManifestSchema(_Loose):
    """The fields of tq_manifest.json that readers rely on (docs/format.md)."""

    format_version: StrictInt
    tq_version: str
    tensors: list[_Tensor]
    rotations: dict[str, _Rotation] = Field(default_factory=dict)
    shards: dict[str, str]
    guard: str | None = None


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest as converted: canonical JSON without the `eval` results."""
    body = {k: v for k, v in manifest.items() if k != "eval"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of config.json as converted, all but the manifest_sha256 inside it (which
    is written after the manifest that records this digest)."""
    body = json.loads(json.dumps(config))
    if isinstance(body.get("quantization_config"), dict):
        body["quantization_config"].pop("manifest_sha256", None)
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def validate_manifest(path: Path, data: dict[str, Any]) -> ManifestSchema:
    try:
        return ManifestSchema.model_validate(data)
    except ValidationError as e:
        where, what = first_error(e)
        raise CorruptFileError(f"{path}: invalid manifest at '{where}': {what}; {HOW}") \
            from None


def expected_storage(path: Path, m: ManifestSchema) -> dict[str, tuple[str, list[int]]]:
    """key -> (dtype, shape) of every tensor the manifest says the shards hold."""
    out: dict[str, tuple[str, list[int]]] = {}

    def add(key: str, dtype: str, shape: list[int], owner: str) -> None:
        if key in out:
            raise CorruptFileError(f"{path}: key '{key}' is claimed twice (again by "
                                   f"'{owner}'); {HOW}")
        out[key] = (dtype, list(shape))

    try:
        converted = {e.name: e for e in converted_entries(m.model_dump())}
    except ValueError as e:
        raise CorruptFileError(f"{path}: {e}; {HOW}") from None
    runs_as: dict[str, str] = {}
    for t in m.tensors:
        if t.action != "quantize":
            continue
        c = converted[t.name]
        module = c.placed if c.placed is not None else t.name.removesuffix(".weight")
        target = module if c.expert is None else f"{module}#{c.expert.index}.{c.expert.role}"
        if target in runs_as:
            raise CorruptFileError(f"{path}: converted tensors '{runs_as[target]}' and "
                                   f"'{t.name}' both run as module '{module}'; {HOW}")
        runs_as[target] = t.name
        stored_as = t.name.removesuffix(".weight").rpartition(".")[2]
        if t.head and c.placed is not None and stored_as != c.placed.rpartition(".")[2] \
                and c.embedding is None:  # (the embedding's path may be renamed)
            raise CorruptFileError(f"{path}: head '{t.name}' runs as '{c.placed}' but names no "
                                   f"input embedding it is stored for; {HOW}")
    for t in m.tensors:
        if t.dtype not in DTYPES or any(d < 0 for d in t.shape):
            raise CorruptFileError(f"{path}: tensor '{t.name}' has dtype '{t.dtype}' or shape "
                                   f"{t.shape}, which no tensor can have; {HOW}")
        if t.action == "keep":
            add(t.name, t.dtype, t.shape, t.name)
            continue
        c = converted[t.name]
        if c.rotation_kind == "none":
            if c.rotation_id is not None:
                raise CorruptFileError(f"{path}: tensor '{t.name}' has no rotation but names "
                                       f"rotation '{c.rotation_id}'; {HOW}")
        else:
            want = rotation_id(c.rotation_kind, c.shape[1], c.block, c.seed)
            r = m.rotations.get(c.rotation_id or "")
            if c.rotation_id != want or r is None or (r.kind, r.n, r.block, r.seed) != (
                    c.rotation_kind, c.shape[1], c.block, c.seed):
                raise CorruptFileError(
                    f"{path}: tensor '{t.name}' names rotation '{c.rotation_id}', which does "
                    f"not match its kind, width, block and seed ('{want}'); {HOW}")
        for key, (dtype, shape) in c.storage().items():
            add(key, dtype, shape, t.name)
    if m.guard is not None:
        if m.guard not in converted:
            raise CorruptFileError(f"{path}: guard '{m.guard}' is not a converted tensor; "
                                   f"{HOW}")
        add(m.guard, GUARD_DTYPE, list(GUARD_SHAPE), "guard")
    for rid, r in m.rotations.items():
        if rid != rotation_id(r.kind, r.n, r.block, r.seed):
            raise CorruptFileError(f"{path}: rotation '{rid}' does not match its kind, width, "
                                   f"block and seed; {HOW}")
        for suffix, (dtype, shape) in material_layout(r.kind, r.n, r.block).items():
            add(rotation_key(rid, suffix), dtype, shape, rid)
    return out


def _read_json(path: Path) -> Any:
    try:
        return loads_strict(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing; {HOW}") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptFileError(f"{path}: not valid JSON; {HOW}") from None


def verify_checkpoint(folder: Path, manifest: dict[str, Any],
                      checksums: bool = True) -> ManifestSchema:
    """Raise CorruptFileError naming the first thing that is not as `convert` wrote it."""
    mpath = folder / MANIFEST
    m = validate_manifest(mpath, manifest)
    config = _read_json(folder / "config.json")
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise CorruptFileError(f"{folder / 'config.json'}: no quantization_config with "
                               f"quant_method '{QUANT_METHOD}'; {HOW}")
    recorded = qc.get("manifest_sha256")
    if recorded is None and "config_sha256" in manifest:  # written together since v0.1
        raise CorruptFileError(f"{folder / 'config.json'}: has no manifest_sha256 although "
                               f"the manifest records config_sha256; {HOW}")
    if recorded is not None and recorded != manifest_digest(manifest):
        raise CorruptFileError(f"{mpath}: does not match the manifest_sha256 recorded in "
                               f"config.json; {HOW}")
    if "config_sha256" in manifest and manifest["config_sha256"] != config_digest(config):
        raise CorruptFileError(f"{folder / 'config.json'}: does not match the config_sha256 "
                               f"recorded in {MANIFEST}; {HOW}")
    storage = expected_storage(mpath, m)
    index = _read_json(folder / INDEX_NAME)
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CorruptFileError(f"{folder / INDEX_NAME}: no weight_map object; {HOW}")
    for key, shard in wmap.items():
        if key not in storage:
            raise CorruptFileError(f"{folder / INDEX_NAME}: maps '{key}', which the manifest "
                                   f"does not list; {HOW}")
        if shard not in m.shards:
            raise CorruptFileError(f"{folder / INDEX_NAME}: maps '{key}' to '{shard}', a shard "
                                   f"the manifest does not list; {HOW}")
    missing = sorted(set(storage) - set(wmap))
    if missing:
        raise CorruptFileError(f"{folder / INDEX_NAME}: does not map '{missing[0]}', which the "
                               f"manifest lists; {HOW}")
    for shard in m.shards:
        path = folder / shard
        if Path(shard).name != shard or not path.is_file():
            raise CorruptFileError(f"{path}: shard named in the manifest is missing; {HOW}")
        header, _, _ = read_header(path)  # tq's validating reader: names the shard
        mine = {k for k, s in wmap.items() if s == shard}
        extra = sorted(set(header) - mine)
        if extra:
            raise CorruptFileError(f"{path}: holds '{extra[0]}', which the index maps "
                                   f"elsewhere or not at all; {HOW}")
        for key in sorted(mine):
            entry = header.get(key)
            dtype, shape = storage[key]
            if entry is None:
                raise CorruptFileError(f"{path}: has no tensor '{key}', which the index maps "
                                       f"to it; {HOW}")
            if entry["dtype"] != dtype or list(entry["shape"]) != shape:
                raise CorruptFileError(
                    f"{path}: tensor '{key}' is {entry['dtype']} {entry['shape']}, the "
                    f"manifest implies {dtype} {shape}; {HOW}")
    if checksums:
        verify_shard_checksums(folder, m.shards)
    return m


def verify_shard_checksums(folder: Path, shards: dict[str, str]) -> None:
    """Compare each shard's sha256 with the manifest; raise naming the first bad one."""
    for shard, want in shards.items():
        got = file_sha256(folder / shard)
        if got != want:
            raise CorruptFileError(
                f"{folder / shard}: checksum mismatch (manifest {want[:12]}…, file "
                f"{got[:12]}…); the shard is damaged, convert again or re-download it")

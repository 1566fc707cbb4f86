"""Format v1 is what tq_cli.io.format says it is: the keys, dtypes and shapes a converted
tiny Llama holds, the manifest's converted entries and the guard, read back from the
shards' own headers (tq's writer never consulted), and the format version refused by
name when it is newer."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.io.checkpoint import Checkpoint
from tq_cli.io.format import (
    COL_SCALE,
    FORMAT_VERSION,
    GUARD_DTYPE,
    GUARD_SHAPE,
    MANIFEST,
    QUANT_METHOD,
    ROTATION_PREFIX,
    SUFFIXES,
    converted_entries,
    rotation_key,
    storage_layout,
    stored_key,
    stored_tensors,
    version_for,
)
from tq_cli.io.manifest import read_manifest
from tq_cli.io.safetensors_reader import DTYPES, INDEX_NAME, read_header
from tq_cli.io.writer import nbytes
from tq_cli.quant.grouped import QuantizedTensor
from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import material_layout
from tq_cli.quant.spec import QuantSpec, RotationSpec


@pytest.fixture(scope="module", params=["hadamard", "orthogonal", "none"])
def converted(request: pytest.FixtureRequest, tiny_llama: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("format") / f"tq-{request.param}"
    # the body's format under each rotation; a head stored quantized (its own spec, always
    # Hadamard) is tests/test_stored_head.py's
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=3, group_size=64),
                                         rotation=RotationSpec(kind=request.param),
                                         max_shard_bytes=60_000, head_bits=None))
    return out


def _headers(folder: Path) -> dict[str, dict]:
    """Every tensor's header entry over all shards of a folder, by key."""
    out: dict[str, dict] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        header, _, _ = read_header(shard)
        assert not set(header) & set(out), shard
        out.update(header)
    return out


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def test_the_constants_are_what_the_writer_wrote(converted: Path) -> None:
    # A folder without a quantized tied head is written in version 2, which older
    # readers read; version 3 only where a converted head is also the input embedding.
    version = version_for(tied_head=False)
    assert version == 2 < FORMAT_VERSION == version_for(tied_head=True) == 3
    qc = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format_version"]) == (QUANT_METHOD, version)
    assert _manifest(converted)["format_version"] == version
    for shard in converted.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata()["tq_format_version"] == str(version)


def test_suffixes_are_the_stored_fields_of_a_quantized_tensor() -> None:
    tensors = [f.name for f in dataclasses.fields(QuantizedTensor) if f.type == "torch.Tensor"]
    assert SUFFIXES == tuple(tensors) == ("codes", "scales", "codebook", "outlier_idx",
                                          "outlier_val")
    assert stored_key("m.q.weight", "codes") == "m.q.weight.codes"
    assert rotation_key("hadamard-n96-b64-s0", "signs") == \
        f"{ROTATION_PREFIX}hadamard-n96-b64-s0.signs"


def test_stored_keys_are_exactly_the_ones_format_names(converted: Path,
                                                       tiny_llama: Path) -> None:
    source = set(_headers(tiny_llama))
    stored = set(_headers(converted))
    index = json.loads((converted / INDEX_NAME).read_text())["weight_map"]
    assert set(index) == stored
    man = _manifest(converted)
    entries = converted_entries(man)
    names = {e.name for e in entries}
    assert names and names < source  # some converted, some kept
    rotations = {rotation_key(rid, suffix)
                 for rid, r in man.get("rotations", {}).items()
                 for suffix in material_layout(r["kind"], r["n"], r["block"])}
    # the default conversion scales every weight's columns (format version 2)
    assert all(e.spec.col_scale == "sinkhorn" for e in entries)
    suffixes = (*SUFFIXES, COL_SCALE)
    want = ((source - names) | {stored_key(n, s) for n in names for s in suffixes}
            | {man["guard"]} | rotations)
    assert stored == want
    assert {k for k in stored if k.startswith(ROTATION_PREFIX)} == rotations
    assert bool(rotations) == (converted.name != "tq-none")
    for e in entries:
        assert e.keys == {s: f"{e.name}.{s}" for s in suffixes}


def test_converted_entries_are_every_converted_tensor_and_nothing_else(
        converted: Path, tiny_llama: Path) -> None:
    man = read_manifest(converted)
    entries = converted_entries(man)
    stored = set(_headers(converted))
    # Converted, as the shards show it: a source weight stored as codes, not as itself.
    by_shards = [n for n in _headers(tiny_llama) if stored_key(n, "codes") in stored]
    assert sorted(e.name for e in entries) == sorted(by_shards)
    assert [e.name for e in entries] == [t["name"] for t in man["tensors"]
                                         if t["name"] in set(by_shards)]
    source = _headers(tiny_llama)
    for e, t in zip(entries, [t for t in man["tensors"] if t["name"] in set(by_shards)],
                    strict=True):
        assert list(e.shape) == source[e.name]["shape"] == t["shape"]
        assert e.spec == QuantSpec(**t["spec"]) and e.spec.bits == 3
        assert e.module == e.name.removesuffix(".weight")
        assert (e.rotation_kind, e.rotation_id) == (t["rotation"]["kind"], t["rotation"]["id"])
        assert (e.rotation_id is None) == (converted.name == "tq-none")
        assert e.rel_error == t["rel_error"]
    assert converted_entries({"format_version": 1, "tensors": [
        t for t in man["tensors"] if t["action"] == "keep"]}) == []


def test_layout_and_guard_agree_with_the_shard_headers(converted: Path) -> None:
    headers = _headers(converted)
    man = _manifest(converted)
    entries = converted_entries(man)
    for e in entries:
        layout = storage_layout(e.shape[0], e.shape[1], e.spec)
        assert list(layout) == [*SUFFIXES, COL_SCALE]
        assert layout[COL_SCALE] == ("F16", [e.shape[1]])
        assert e.storage() == {e.keys[s]: layout[s] for s in layout}
        for key, (dtype, shape) in e.storage().items():
            assert (headers[key]["dtype"], headers[key]["shape"]) == (dtype, shape), key
    guard = man["guard"]
    assert guard == entries[0].name  # the first converted weight's own name
    assert (headers[guard]["dtype"], headers[guard]["shape"]) == (GUARD_DTYPE,
                                                                   list(GUARD_SHAPE))


def test_what_a_reader_rebuilds_is_stored_back_under_the_same_keys(converted: Path) -> None:
    ck = Checkpoint(converted)
    where = json.loads((converted / INDEX_NAME).read_text())["weight_map"]
    for e in converted_entries(ck.manifest):
        stored = stored_tensors(e.name, ck.quantized(e.name))
        assert list(stored) == list(e.keys.values())
        for key, t in stored.items():
            with safe_open(str(converted / where[key]), framework="pt") as f:
                assert torch.equal(f.get_tensor(key), t), key


@pytest.mark.parametrize(("shape", "bits", "group", "outliers"),
                         [((64, 96), 3, 64, 0.01), ((40, 200), 2, 32, 0.0),
                          ((17, 130), 4, 64, 0.003), ((8, 64), 8, 64, 0.05)])
def test_storage_layout_is_what_quantize_makes(shape: tuple[int, int], bits: int, group: int,
                                               outliers: float) -> None:
    torch.manual_seed(0)
    spec = QuantSpec(bits=bits, group_size=group, outliers=outliers)
    q = quantize(torch.randn(*shape), spec, RotationSpec(kind="orthogonal"))
    layout = storage_layout(*shape, spec)
    stored = stored_tensors("w", q)
    assert list(stored) == [stored_key("w", s) for s in SUFFIXES]
    for s in SUFFIXES:
        t = stored[stored_key("w", s)]
        assert (DTYPES[layout[s][0]][0], list(t.shape)) == (t.dtype, layout[s][1]), s
    assert q.nbytes() == sum(nbytes(d, tuple(sh)) for d, sh in layout.values())


def test_a_newer_format_version_is_refused_by_name(converted: Path, tmp_path: Path) -> None:
    d = tmp_path / "newer"
    shutil.copytree(converted, d)
    man = _manifest(d)
    man["format_version"] = FORMAT_VERSION + 1
    (d / MANIFEST).write_text(json.dumps(man))
    refusal = (f"format version {FORMAT_VERSION + 1} is newer than this tq reads "
               f"({FORMAT_VERSION}); upgrade tq")
    with pytest.raises(TqError, match="^" + re.escape(f"{d / MANIFEST}: {refusal}") + "$"):
        read_manifest(d)
    with pytest.raises(TqError, match=re.escape(refusal)):
        Checkpoint(d)
    with pytest.raises(TqError, match="^" + re.escape(f"{MANIFEST}: {refusal}")):
        converted_entries(man)


def test_a_converted_entry_without_its_spec_is_named(converted: Path) -> None:
    man = _manifest(converted)
    entry = next(t for t in man["tensors"] if t["action"] == "quantize")
    del entry["spec"]
    with pytest.raises(ValueError, match=f"converted tensor '{entry['name']}' has no spec"):
        converted_entries(man)

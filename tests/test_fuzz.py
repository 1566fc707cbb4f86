"""Seeded fuzzing of every file tq reads: a mutated file is read fine or refused with a
TqError (one line at the CLI), never any other exception, and nothing the user had is
touched.

Families: safetensors headers (convert's reader), checkpoint manifests, config.json
and index (the loader's checks, half of them "resealed" so the structural checks, not
the digest, must catch them), recipes, calibration files and SEEDS files. Each family
runs a few hundred cases of random structural edits (a field deleted, or replaced by a
value of another type, out of range or deeply nested) and byte edits (flips, cuts,
insertions), all from fixed seeds, so a failure reproduces exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_safetensors
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert, partial_path
from tq_cli.errors import TqError
from tq_cli.io.checkpoint import Checkpoint
from tq_cli.io.integrity import manifest_digest
from tq_cli.io.safetensors_reader import open_source
from tq_cli.io.writer import file_sha256
from tq_cli.quant.spec import QuantSpec

CASES = 500
ODD: list[Any] = [None, True, False, 0, -1, 2**64, -(2**63), 1.5, float("inf"), "",
                  "x", "F32", [], [1, 2], {}, {"a": 1}, [[[[[[[[[[[]]]]]]]]]]], "9" * 400]


def _paths(obj: Any, here: tuple = ()) -> list[tuple]:
    out = [here]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*here, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            out += _paths(v, (*here, i))
    return out


def _mutate_json(doc: Any, rng: random.Random) -> Any:
    """A structural edit: replace or delete one node anywhere in the document."""
    doc = json.loads(json.dumps(doc))
    path = rng.choice(_paths(doc)[1:] or [()])
    if not path:
        return rng.choice(ODD)
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if rng.random() < 0.25 and isinstance(parent, dict):
        del parent[last]
    elif rng.random() < 0.1:
        parent[last] = DEEP  # becomes 5000 nested lists in the dumped text
    else:
        parent[last] = rng.choice(ODD)
    return doc


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    op = rng.randrange(4)
    if op == 0 and data:  # flip a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 1:  # cut
        del data[rng.randrange(len(data) + 1):]
    elif op == 2:  # insert junk
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:  # invalid UTF-8
        data[rng.randrange(len(data) + 1):0] = b"\xff\xfe"
    return bytes(data)


DEEP = "__deeply_nested__"


def _dump(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True).replace(f'"{DEEP}"', "[" * 5000 + "]" * 5000)


def _holds(fn: Callable[[], object]) -> str:
    """Run one case: 'ok' or 'refused'; any other exception fails the test."""
    try:
        fn()
    except TqError as e:
        assert "\n" not in str(e), str(e)
        return "refused"
    return "ok"


# ------------------------------------------------------------------ safetensors headers


def test_fuzz_safetensors_header(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    shard = folder / "model.safetensors"
    write_safetensors(shard, {"a.weight": torch.randn(8, 16), "b": torch.ones(4)})
    raw = shard.read_bytes()
    hlen = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8:8 + hlen]), raw[8 + hlen:]
    rng = random.Random(1)
    seen = {"ok": 0, "refused": 0}
    for _ in range(CASES):
        if rng.random() < 0.6:
            text = _dump(_mutate_json(header, rng)).encode()
            data = struct.pack("<Q", len(text)) + text + body
        else:
            data = _mutate_bytes(raw, rng)
        shard.write_bytes(data)
        seen[_holds(lambda: open_source(folder))] += 1
    assert seen["refused"] > CASES // 2 and seen["ok"] > 0


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("fz") / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    torch.manual_seed(0)
    write_safetensors(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 96),
        "model.layers.0.mlp.down_proj.weight": torch.randn(96, 32),
        "model.norm.weight": torch.ones(96)})
    out = src.parent / "tq"
    convert(src, out, ConvertSpec(quant=QuantSpec(group_size=32), allow_partial=True))
    return out


def _reseal(folder: Path) -> None:
    try:
        man = json.loads((folder / "tq_manifest.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
        man["shards"] = {s: file_sha256(folder / s) for s in man["shards"]}
        (folder / "tq_manifest.json").write_text(_dump(man))
        cfg["quantization_config"]["manifest_sha256"] = manifest_digest(man)
        (folder / "config.json").write_text(_dump(cfg))
    except Exception:  # a mutation that leaves nothing to reseal: test it as it is
        pass


@pytest.mark.parametrize("target", ["tq_manifest.json", "config.json",
                                    "model.safetensors.index.json"])
def test_fuzz_checkpoint_files(checkpoint: Path, tmp_path: Path, target: str) -> None:
    d = tmp_path / "ck"
    shutil.copytree(checkpoint, d)
    original = (d / target).read_bytes()
    doc = json.loads(original)
    rng = random.Random(hash(target) % 1000)
    seen = {"ok": 0, "refused": 0}
    for i in range(CASES):
        text = (_dump(_mutate_json(doc, rng)).encode() if rng.random() < 0.7
                else _mutate_bytes(original, rng))
        (d / target).write_bytes(text)
        if i % 2:
            _reseal(d)
        seen[_holds(lambda: Checkpoint(d, verify_checksums=True))] += 1
        shutil.rmtree(d)
        shutil.copytree(checkpoint, d)
    # A resealed manifest edit that only touches what no reader uses (the summary, an
    # error figure) still loads; everything else is refused.
    assert seen["refused"] > CASES // 2


# ------------------------------------------------------------------ recipes


def test_fuzz_recipe(tmp_path: Path) -> None:
    from tq_cli.planning.recipe import builtin_recipes, load_recipe

    original = builtin_recipes()["llama"].read_bytes()
    path = tmp_path / "r.toml"
    rng = random.Random(3)
    seen = {"ok": 0, "refused": 0}
    for _ in range(CASES):
        data = _mutate_bytes(original, rng)
        if rng.random() < 0.3:  # a value of another type for a key
            data = data.replace(b'"', b"", rng.randint(0, 4)).replace(b"[", b"{", 1)
        path.write_bytes(data)
        seen[_holds(lambda: load_recipe(path))] += 1
    assert seen["refused"] > CASES // 4 and seen["ok"] > 0


# ------------------------------------------------------------------ calibration files


def test_fuzz_calibration_header(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tq_cli.calibration.collect import CalibSpec, calibrate
    from tq_cli.io.calibration import META_KEY, read_calibration

    good = tmp_path / "good.calib"
    calibrate(tiny_llama, good, CalibSpec(samples=2, seqlen=16, device="cpu"))
    source = open_source(tiny_llama)
    with safe_open(str(good), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = json.loads(f.metadata()[META_KEY])
    path = tmp_path / "bad.calib"
    rng = random.Random(4)
    seen = {"ok": 0, "refused": 0}
    for _ in range(CASES // 2):
        if rng.random() < 0.6:
            save_file(tensors, path, metadata={META_KEY: _dump(_mutate_json(meta, rng))})
        else:
            path.write_bytes(_mutate_bytes(good.read_bytes()[:4096], rng)
                             + good.read_bytes()[4096:])

        def read() -> None:
            cal = read_calibration(path)
            cal.check_source(source)
            for name in cal.meta["tensors"]:
                cal.hessian(name)

        seen[_holds(read)] += 1
    assert seen["refused"] > CASES // 8


# ------------------------------------------------------------------ SEEDS files


def test_fuzz_seeds_file(tiny_llama: Path, tmp_path: Path) -> None:
    from tq_cli.io.seeds import read_seeds
    from tq_cli.quant.spec import RotationSpec
    from tq_cli.seedsearch.grid import SearchSpec, search

    good = tmp_path / "seeds.json"
    doc = search(tiny_llama, good, SearchSpec(seeds=[0, 1], finalists=1, device="cpu",
                                              quant=QuantSpec(group_size=32)))
    source = open_source(tiny_llama)
    path = tmp_path / "bad.json"
    rng = random.Random(5)
    seen = {"ok": 0, "refused": 0}
    for _ in range(CASES):
        data = (_dump(_mutate_json(doc, rng)).encode() if rng.random() < 0.7
                else _mutate_bytes(good.read_bytes(), rng))
        path.write_bytes(data)
        seen[_holds(lambda: read_seeds(path, source, RotationSpec()))] += 1
    assert seen["refused"] > CASES // 4


# ------------------------------------------------------------------ through the CLI


def _tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def test_fuzz_convert_cli_one_line_and_nothing_left(tmp_path: Path) -> None:
    """Mutated sources through `tq convert`: exit 0, 1 or 2; on failure one line on
    stderr, no OUT and no partial folder; the source is never modified."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    torch.manual_seed(0)
    write_safetensors(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 64),
        "model.norm.weight": torch.ones(64)})
    raw = (src / "model.safetensors").read_bytes()
    cfg = json.loads((src / "config.json").read_text())
    runner = CliRunner()
    rng = random.Random(6)
    for i in range(24):
        if i % 2:
            (src / "model.safetensors").write_bytes(_mutate_bytes(raw, rng))
            (src / "config.json").write_text(_dump(cfg))
        else:
            (src / "model.safetensors").write_bytes(raw)
            (src / "config.json").write_text(_dump(_mutate_json(cfg, rng)))
        before = _tree_hash(src)
        out = tmp_path / f"o{i}"
        r = runner.invoke(app, ["convert", str(src), "-o", str(out), "--group-size", "32"])
        assert r.exit_code in (0, 1, 2), (r.exit_code, r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        if r.exit_code:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            # The boundary catches a tq bug as "internal error: ...": that is not a held case.
            assert "internal error:" not in r.stderr, r.stderr
            assert not out.exists() and not partial_path(out).exists(), r.stderr
        assert _tree_hash(src) == before

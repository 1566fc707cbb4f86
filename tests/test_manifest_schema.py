"""A manifest edited and re-sealed (its digests recomputed, as a buggy tool or a hand edit
would do) loads as the same model or is refused with one tq error: never a raw exception,
never a silently different model."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinymodels import build_tiny_llama

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import CorruptFileError, TqError
from tq_cli.io.integrity import manifest_digest

IDS = torch.arange(3, 19)[None]


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A converted tiny tied Llama (its head stored once, at 8 bits) and its logits."""
    root = tmp_path_factory.mktemp("schema")
    out = root / "tq"
    convert(build_tiny_llama(root / "src", tied=True, seed=4), out, ConvertSpec(fast=True))
    with torch.no_grad():
        logits = tq_cli.load(out, compile=False)(IDS).logits
    return out, logits


def _resealed(src: Path, dst: Path, manifest: dict[str, Any],
              shard_edit: tuple[str, torch.Tensor] | None = None) -> Path:
    """A copy of `src` with `manifest` written and every digest recomputed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors" and shard_edit is None:
            os.link(f, dst / f.name)  # read-only use: no copy needed
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    if shard_edit is not None:
        from safetensors.torch import load_file, save_file

        key, value = shard_edit
        for shard in dst.glob("*.safetensors"):
            tensors = load_file(shard)
            if key in tensors:
                tensors[key] = value
                save_file(tensors, shard, metadata={"format": "pt"})
                manifest["shards"][shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (dst / "tq_manifest.json").write_text(json.dumps(manifest, indent=1))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["manifest_sha256"] = manifest_digest(manifest)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "tq_manifest.json").read_text())


def _entry(manifest: dict[str, Any], pred: Any) -> dict[str, Any]:
    return next(e for e in manifest["tensors"] if pred(e))


def test_the_reseal_itself_loads_the_same_model(sealed: tuple[Path, torch.Tensor],
                                                tmp_path: Path) -> None:
    src, logits = sealed
    folder = _resealed(src, tmp_path / "same", _manifest(src))
    with torch.no_grad():
        assert torch.equal(tq_cli.load(folder, compile=False)(IDS).logits, logits)


def test_nonfinite_column_scales_are_refused(sealed: tuple[Path, torch.Tensor],
                                             tmp_path: Path) -> None:
    src, _ = sealed
    m = _manifest(src)
    e = _entry(m, lambda e: e["action"] == "quantize" and "mlp.down_proj" in e["name"])
    key = next(k for k in e["keys"] if k.endswith(".col_scale"))
    from safetensors import safe_open

    shard = src / e["shards"][0]
    with safe_open(str(shard), "pt") as f:
        bad = f.get_tensor(key).clone()
    bad[3] = float("nan")
    folder = _resealed(src, tmp_path / "nan", m, (key, bad))
    with pytest.raises(CorruptFileError, match=rf"stored tensor '{e['name']}\.col_scale' holds "
                       "NaN or infinite values, which tq never writes"):
        tq_cli.load(folder, compile=False)


def test_a_head_without_its_embedding_is_refused(sealed: tuple[Path, torch.Tensor],
                                                 tmp_path: Path) -> None:
    src, _ = sealed
    m = _manifest(src)
    head = _entry(m, lambda e: e.get("head"))
    assert head["name"] == "model.embed_tokens.weight" and head["module"] == "lm_head"
    del head["embedding"]
    with pytest.raises(CorruptFileError, match=re.escape(
            "head 'model.embed_tokens.weight' runs as 'lm_head' but names no input embedding "
            "it is stored for")):
        tq_cli.load(_resealed(src, tmp_path / "h", m), compile=False)


def test_two_entries_running_as_one_module_are_refused(sealed: tuple[Path, torch.Tensor],
                                                       tmp_path: Path) -> None:
    src, _ = sealed
    m = _manifest(src)
    q = _entry(m, lambda e: e["name"] == "model.layers.0.self_attn.q_proj.weight")
    q["module"] = "model.layers.0.self_attn.k_proj"
    with pytest.raises(CorruptFileError, match=re.escape(
            "converted tensors 'model.layers.0.self_attn.k_proj.weight' and "
            "'model.layers.0.self_attn.q_proj.weight' both run as module "
            "'model.layers.0.self_attn.k_proj'")):
        tq_cli.load(_resealed(src, tmp_path / "m", m), compile=False)


def test_an_unknown_fit_is_refused(sealed: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    src, _ = sealed
    m = _manifest(src)
    i, _e = next((i, e) for i, e in enumerate(m["tensors"]) if e["action"] == "quantize")
    m["tensors"][i]["fit"] = "magic"
    with pytest.raises(CorruptFileError, match=rf"invalid manifest at 'tensors\.{i}\.fit'"):
        tq_cli.load(_resealed(src, tmp_path / "f", m), compile=False)


FIELDS = ["name", "shape", "dtype", "action", "keys", "shards", "module", "head", "embedding",
          "fit", "calibrated", "rel_error", "bits_per_weight", "spec", "rotation",
          "spec.bits", "spec.group_size", "spec.codebook", "spec.col_scale", "spec.outliers",
          "rotation.kind", "rotation.block", "rotation.seed", "rotation.id", "expert"]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70000), st.floats(-1e6, 1e6),
    st.sampled_from(["", "lm_head", "model.layers.0.mlp.up_proj", "model.embed_tokens",
                     "gptq", "weight-only", "hadamard", "orthogonal", "none", "F32", "BF16",
                     "quantize", "keep", "model.layers.1.self_attn.v_proj.weight"]),
    st.lists(st.integers(0, 600), max_size=3), st.dictionaries(st.text(max_size=4),
                                                              st.integers(), max_size=2))
_counter = [0]


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(index=st.integers(0, 10_000), field=st.sampled_from(FIELDS), value=VALUES)
def test_any_field_edit_resealed_is_the_same_model_or_one_tq_error(
        sealed: tuple[Path, torch.Tensor], tmp_path: Path, index: int, field: str,
        value: Any) -> None:
    src, logits = sealed
    m = _manifest(src)
    entry = m["tensors"][index % len(m["tensors"])]
    edited = copy.deepcopy(m)
    target = edited["tensors"][index % len(m["tensors"])]
    *path, last = field.split(".")
    for p in path:
        target = target.get(p) if isinstance(target, dict) else None
    if not isinstance(target, dict):
        return  # that entry has no such sub-record (a kept tensor's spec)
    target[last] = value
    if edited == m:
        return
    _counter[0] += 1
    folder = _resealed(src, tmp_path / f"e{_counter[0]}", edited)
    try:
        model = tq_cli.load(folder, compile=False)
    except TqError as e:
        assert "\n" not in str(e) and not str(e).startswith("internal error"), str(e)
        return
    with torch.no_grad():
        got = model(IDS).logits
    assert torch.equal(got, logits), (entry["name"], field, value)

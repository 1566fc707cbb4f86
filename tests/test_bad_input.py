"""Every kind of bad input gets a one-line error naming the file, the tensor and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_safetensors

from tq_cli.conversion.converter import ConvertSpec, convert, partial_path
from tq_cli.errors import TqError


def fails(folder: Path, out: Path, match: str, spec: ConvertSpec | None = None) -> None:
    with pytest.raises(TqError, match=match):
        convert(folder, out, spec)
    assert not out.exists() or (spec is not None and not spec.overwrite)


def test_missing_folder(tmp_path: Path) -> None:
    fails(tmp_path / "nope", tmp_path / "out",
          r"nope: no such folder; pass a model folder or a hub id \(org/name\)")


def test_missing_hub_id_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    fails(Path("tq-test/not-a-model"), tmp_path / "out",
          "tq-test/not-a-model: not in the local Hugging Face cache and HF_HUB_OFFLINE is set")


def test_folder_without_safetensors(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"x")
    fails(folder, tmp_path / "out",
          r"no model.safetensors or model.safetensors.index.json; tq reads safetensors only "
          r"\(found pytorch_model.bin; save it with safe_serialization=True first\)")


def test_truncated_shard(small_folder: Path, tmp_path: Path) -> None:
    f = small_folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    fails(small_folder, tmp_path / "out",
          r"model.safetensors: tensor '.*' is truncated \(header says it ends at byte \d+, "
          r"file has \d+\); re-download the shard")


def test_header_lies_about_size(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"a.weight": torch.randn(8, 8)},
                      {"a.weight": {"shape": [8, 16]}})
    fails(folder, tmp_path / "out",
          r"model.safetensors: tensor 'a.weight' header says shape \[8, 16\] of F32 \(512 bytes\) "
          r"but data_offsets \[0, 256\] span 256; the file is corrupt, re-download it")


def test_header_overlapping_offsets(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors",
                      {"a": torch.randn(4), "b": torch.randn(4)}, {"b": {"data_offsets": [8, 24]}})
    fails(folder, tmp_path / "out", r"tensors 'a' and 'b' overlap in the data section")


def test_header_length_past_end(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    fails(folder, tmp_path / "out", r"header length 1000000 runs past the end of the file")


def _sharded(tmp_path: Path, wmap: dict[str, str]) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model-00001-of-00001.safetensors", {"a.weight": torch.randn(4)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return folder


def test_index_names_missing_shard(tmp_path: Path) -> None:
    folder = _sharded(tmp_path, {"a.weight": "model-00001-of-00001.safetensors",
                                 "b.weight": "model-00002-of-00002.safetensors"})
    fails(folder, tmp_path / "out",
          r"model.safetensors.index.json: names shard 'model-00002-of-00002.safetensors' "
          r"\(for tensor 'b.weight'\), which is not in .*; re-download it")


def test_index_entry_outside_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"secret")
    folder = _sharded(tmp_path, {"a.weight": "../../x"})
    fails(folder, tmp_path / "out",
          r"weight_map entry for 'a.weight' points to '../../x', outside the model folder; "
          "refused")


def test_unknown_dtype(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"a.weight": torch.randn(4)},
                      {"a.weight": {"dtype": "F4"}})
    fails(folder, tmp_path / "out",
          r"model.safetensors: tensor 'a.weight' has dtype 'F4', which tq cannot read")


def test_integer_weight_cannot_be_quantized(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors",
                      {"model.layers.0.mlp.up_proj.weight": torch.ones(8, 16, dtype=torch.int32)})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fails(folder, tmp_path / "out",
          r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' has dtype I32, which "
          r"tq cannot quantize .*; add a keep rule for it to the recipe")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_is_refused_unless_allowed(tmp_path: Path, bad: float) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    w = torch.randn(16, 64)
    w[3, 4] = bad
    w[5, 6] = bad
    write_safetensors(folder / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": w})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "out"
    fails(folder, out,
          r"model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' contains 2 NaN/Inf "
          r"values; fix the source or pass --allow-nonfinite to quantize them as 0",
          ConvertSpec(allow_partial=True))
    assert not out.exists()
    r = convert(folder, out, ConvertSpec(allow_partial=True, allow_nonfinite=True))
    assert r.tensors_converted == 1 and any("2 NaN/Inf" in w for w in r.warnings)
    man = json.loads((out / "tq_manifest.json").read_text())
    assert man["summary"]["nonfinite_values"] == 2


def test_existing_output_is_refused_and_untouched(small_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(TqError, match=r"out: already exists; pass --overwrite to replace it"):
        convert(small_folder, out, ConvertSpec(allow_partial=True))
    with pytest.raises(TqError, match=r"out: exists and is not a tq checkpoint; --overwrite "
                                      "only replaces a tq checkpoint or an empty folder"):
        convert(small_folder, out, ConvertSpec(allow_partial=True, overwrite=True))
    assert (out / "precious.txt").read_text() == "keep me"
    (out / "precious.txt").unlink()
    again = ConvertSpec(allow_partial=True, overwrite=True)
    convert(small_folder, out, again)  # an empty folder is fine
    convert(small_folder, out, again)  # and so is a tq checkpoint
    assert (out / "tq_manifest.json").exists()


def test_output_that_contains_the_source_is_refused(small_folder: Path) -> None:
    with pytest.raises(TqError, match="contains the source folder"):
        convert(small_folder, small_folder.parent, ConvertSpec(overwrite=True))
    assert (small_folder / "model.safetensors").exists()


def test_output_that_is_a_file_is_refused(small_folder: Path, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TqError, match="exists and is not a folder"):
        convert(small_folder, f, ConvertSpec(overwrite=True))
    assert f.read_text() == "x"


def test_model_with_nothing_to_convert(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"model.norm.weight": torch.ones(8)})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fails(folder, tmp_path / "out", "no tensor matches a quantize rule of recipe 'llama'")


def test_invalid_recipe_override_names_the_rule(small_folder: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\n[[rules]]\npattern = "*up_proj*"\nbits = 5\n')
    fails(small_folder, tmp_path / "out",
          r"recipe 'r': rule '\*up_proj\*' \(matching 'model.layers.0.mlp.up_proj.weight'\) "
          "gives invalid settings: bits must be 2, 3, 4 or 8, got 5",
          ConvertSpec(recipe=str(recipe)))


def test_hub_cache_snapshot_with_symlinked_shards(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    write_safetensors(blobs / "1", {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 64)})
    (snap / "model-00001-of-00001.safetensors").symlink_to(blobs / "1")
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.mlp.up_proj.weight": "model-00001-of-00001.safetensors"}}))
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = convert(snap, tmp_path / "out", ConvertSpec(allow_partial=True))
    assert r.tensors_converted == 1


def test_failed_overwrite_keeps_the_old_output(small_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(small_folder, out, ConvertSpec(allow_partial=True))
    before = (out / "model.safetensors").read_bytes()
    w = torch.randn(64, 96)
    w[0, 0] = float("nan")
    write_safetensors(small_folder / "model.safetensors",
                      {"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(96)})
    with pytest.raises(TqError, match="NaN/Inf"):
        convert(small_folder, out, ConvertSpec(allow_partial=True, overwrite=True))
    assert (out / "model.safetensors").read_bytes() == before
    shutil.rmtree(partial_path(out), ignore_errors=True)


def test_output_inside_source_is_refused(small_folder: Path) -> None:
    with pytest.raises(TqError, match="is inside the source folder"):
        convert(small_folder, small_folder / "q")


def test_already_quantized_source_is_refused(small_folder: Path, tmp_path: Path) -> None:
    cfg = {"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}
    (small_folder / "config.json").write_text(json.dumps(cfg))
    fails(small_folder, tmp_path / "out", r"already quantized \(quant_method 'gptq'\)")

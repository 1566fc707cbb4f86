"""Inputs that used to convert or load with exit 0 into something silently wrong: each is
now a one-line refusal naming the file and the tensor, and leaves no output behind."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import write_safetensors

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import CorruptFileError, TqError


def test_weights_below_fp16_scales_are_refused_not_zeroed(small_folder: Path,
                                                          tmp_path: Path) -> None:
    """A layer of values around 1e-8 (merged or pruned checkpoints) used to come back as
    almost zero (relative error 0.99) with exit 0."""
    f = small_folder / "model.safetensors"
    write_safetensors(f, {"model.layers.0.mlp.up_proj.weight": torch.randn(64, 96) * 1e-8,
                          "model.norm.weight": torch.ones(96)})
    out = tmp_path / "out"
    with pytest.raises(TqError) as e:
        convert(small_folder, out, ConvertSpec(allow_partial=True, fast=True))
    msg = str(e.value)
    assert msg.startswith(
        "model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' cannot be stored: its "
        "quantized copy has relative error 0.99; its values (RMS ")
    assert msg.endswith(") are below what fp16 group scales resolve; keep it in full "
                        "precision with a keep rule (--recipe), or rescale the source")
    assert not out.exists()


def test_a_header_naming_a_tensor_twice_is_refused(small_folder: Path, tmp_path: Path) -> None:
    """The safetensors library refuses such a file; tq used to convert the second entry."""
    f = small_folder / "model.safetensors"
    t = torch.randn(64, 96)
    raw = t.numpy().tobytes()
    entry = json.dumps({"dtype": "F32", "shape": [64, 96], "data_offsets": [0, len(raw)]})
    header = (f'{{"model.layers.0.mlp.up_proj.weight": {entry}, '
              f'"model.layers.0.mlp.up_proj.weight": {entry}}}').encode()
    header += b" " * (-len(header) % 8)
    f.write_bytes(struct.pack("<Q", len(header)) + header + raw)
    with pytest.raises(CorruptFileError) as e:
        convert(small_folder, tmp_path / "out", ConvertSpec(fast=True))
    assert str(e.value) == ("model.safetensors: the header has the key "
                            "'model.layers.0.mlp.up_proj.weight' twice; the file is damaged "
                            "or was not written by safetensors, re-export it")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", [5, ["llama"], {"a": 1}])
def test_a_model_type_that_is_not_a_name_is_refused(small_folder: Path, tmp_path: Path,
                                                   model_type: object) -> None:
    """It used to convert into a complete-looking folder that failed to load with a raw
    TypeError."""
    (small_folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(TqError) as e:
        convert(small_folder, tmp_path / "out", ConvertSpec(fast=True))
    assert str(e.value).startswith(f"{small_folder / 'config.json'}: model_type is "
                                   f"{type(model_type).__name__} {model_type!r}, not a name")
    assert not (tmp_path / "out").exists()


def test_a_shard_edited_in_place_with_its_mtime_kept_is_caught(tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    """The once-per-process verification of a folder keyed on size and mtime, so an edit
    that kept both loaded the edited weights."""
    out = tmp_path / "tq"
    convert(tiny_llama, out, ConvertSpec(fast=True))
    tq_cli.load(out)  # verified and remembered
    shard = next(out.glob("*.safetensors"))
    st = shard.stat()
    with open(shard, "r+b") as fh:  # in place (same inode and size): the last data bytes
        fh.seek(-8, os.SEEK_END)
        last = fh.read(8)
        fh.seek(-8, os.SEEK_END)
        fh.write(bytes(b ^ 0x55 for b in last))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(CorruptFileError, match="checksum"):
        tq_cli.load(out)
    shutil.rmtree(out)


def test_a_symlink_loop_or_dangling_link_as_source_is_named(tmp_path: Path) -> None:
    """A loop used to be reported as "cannot reach the Hugging Face hub"."""
    from tq_cli.errors import SourceError

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SourceError) as e:
        convert(tmp_path / "a", tmp_path / "out", ConvertSpec(fast=True))
    assert str(e.value) == (f"{tmp_path / 'a'}: is a symbolic link loop; pass the model "
                            "folder itself")
    with pytest.raises(SourceError) as e:
        convert(tmp_path / "gone", tmp_path / "out", ConvertSpec(fast=True))
    assert str(e.value) == (f"{tmp_path / 'gone'}: is a dangling symbolic link; pass the "
                            "model folder itself")


@pytest.mark.parametrize("below", ["out", "x/y/out"])
def test_an_out_below_a_file_is_named(small_folder: Path, tmp_path: Path, below: str) -> None:
    """It used to say "File exists; free space or fix permissions"."""
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / below
    with pytest.raises(TqError) as e:
        convert(small_folder, out, ConvertSpec(fast=True))
    assert str(e.value) == (f"{out}: {tmp_path / 'afile'} is a file, not a folder; choose "
                            "another OUT")
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_verify_checksums_false_is_honoured_by_the_from_pretrained_inside_load(
        tiny_llama: Path, tmp_path: Path) -> None:
    """load(..., verify_checksums=False) skipped its own checksum pass, but the quantizer's
    check inside from_pretrained read every shard again (and refused this folder)."""
    out = tmp_path / "tq"
    convert(tiny_llama, out, ConvertSpec(fast=True))
    shard = next(out.glob("*.safetensors"))
    with open(shard, "r+b") as fh:  # a data byte, not the header: structure intact
        fh.seek(-8, os.SEEK_END)
        last = fh.read(8)
        fh.seek(-8, os.SEEK_END)
        fh.write(bytes(b ^ 0x01 for b in last))
    tq_cli.load(out, verify_checksums=False)  # asked not to read the shards: loads
    with pytest.raises(CorruptFileError, match="checksum"):
        tq_cli.load(out)  # the default still refuses it

"""The behavioural self-check at the end of a conversion (tq_cli.conversion.selfcheck):
the first and last blocks and the head of what was written run in the family's own code
beside the original, and a checkpoint that crashes or lands far from the original is not
written. The broken checkpoints are made by breaking the kernel the converted layers
call, as a wrong layout or a miscompiled kernel would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import FAMILIES
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.conversion.selfcheck import FAR, SelfCheckError
from tq_cli.quant.spec import QuantSpec
from tq_cli.runtime import tq_linear

SPEC = ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu", fast=True)


def _saved(tmp_path: Path, family: str = "qwen3") -> Path:
    torch.manual_seed(0)
    model, _ = FAMILIES[family]()
    model.save_pretrained(tmp_path / "src")
    return tmp_path / "src"


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "jamba"])
def test_every_conversion_reports_its_self_check(tmp_path: Path, family: str) -> None:
    """Dense, MoE (experts run by TQExperts) and a Mamba hybrid whose code reads a layer's
    weight unless the config says the model is quantized, as a load marks it."""
    r = convert(_saved(tmp_path, family), tmp_path / "out", SPEC)
    check = r.self_check
    assert check is not None and check["ran"] is True and check["tokens"] == 16
    assert set(check["rel_errors"]) == {"block 0", "block 1", "head"}
    assert all(0 < v < 0.4 for v in check["rel_errors"].values())  # 4-bit random weights
    assert check["seconds"] > 0  # its cost at real sizes: docs/results.md


def test_a_checkpoint_far_from_its_original_is_not_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tq_linear.dispatch.linear  # output features in the wrong order: a bad layout
    monkeypatch.setattr(tq_linear.dispatch, "linear", lambda *a, **k: real(*a, **k).flip(-1))
    with pytest.raises(SelfCheckError) as e:
        convert(_saved(tmp_path), tmp_path / "out", SPEC)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'out'}: self-check: block 0 of the converted model "
                          "is ") and "\n" not in msg
    assert float(msg.split(" is ")[1].split()[0]) > FAR
    assert msg.endswith("the checkpoint was not written: report this with the model's "
                        "config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no partial


def test_a_converted_layer_that_crashes_fails_the_conversion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(tq_linear.TQLinear, "forward", broken)
    src = _saved(tmp_path)
    r = CliRunner().invoke(app, ["convert", str(src), "-o", str(tmp_path / "out"), "--fast",
                                 "--json"])
    assert r.exit_code == 1
    assert r.stderr.strip().endswith(
        "self-check: block 0 of the converted model fails in Qwen3ForCausalLM's own forward "
        "(RuntimeError: mat1 and mat2 shapes cannot be multiplied); the checkpoint would not "
        "run, so it was not written")
    assert not (tmp_path / "out").exists()


def test_the_self_check_is_in_the_json_summary(tmp_path: Path) -> None:
    src = _saved(tmp_path)
    r = CliRunner().invoke(app, ["convert", str(src), "-o", str(tmp_path / "out"), "--fast",
                                 "--json"])
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["self_check"]["ran"] is True
    assert 0.0 < summary["quantized_share_non_embedding"] <= 1.0


@pytest.mark.parametrize("family", ["whisper", "clip", "t5"])
def test_a_small_model_whose_blocks_cannot_run_alone_is_checked_whole(
        tmp_path: Path, family: str) -> None:
    """Whisper's audio input, CLIP's two towers, T5's tied encoder embedding: the whole
    converted model, loaded as tq_cli.load loads it, beside the original."""
    r = convert(_saved(tmp_path, family), tmp_path / "out", SPEC)
    check = r.self_check
    assert check is not None and check["ran"] is True and check["whole_model"] is True
    assert 0 < check["rel_errors"]["output"] < 0.4 and check["because"]


def test_a_model_checked_whole_that_is_far_fails(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = tq_linear.dispatch.linear
    monkeypatch.setattr(tq_linear.dispatch, "linear", lambda *a, **k: real(*a, **k).flip(-1))
    with pytest.raises(SelfCheckError, match="self-check: the output of the converted model "
                                             "is "):
        convert(_saved(tmp_path, "whisper"), tmp_path / "out", SPEC)
    assert not (tmp_path / "out").exists()


def test_a_source_that_cannot_be_run_says_why(small_folder: Path, tmp_path: Path) -> None:
    """A few hand-written tensors under a bare config (--allow-partial): no vocabulary to
    draw ids from, and a partial source is not loaded whole; the summary says so."""
    r = convert(small_folder, tmp_path / "out", SPEC.model_copy(update={"allow_partial": True}))
    assert r.self_check is not None and r.self_check["ran"] is False
    assert r.self_check["why"] == ("config.json names no vocab_size to draw token ids from; "
                                   "the source is partial (--allow-partial), so not the "
                                   "whole model")

"""`--self-calib sampled`: calibration sequences the model writes itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.calibration.random_tokens import self_calibration_ids, synthetic_run
from tq_cli.calibration.sampled_tokens import sampled_ids
from tq_cli.conversion.spec import ConvertSpec
from tq_cli.io.manifest import read_manifest
from tq_cli.io.text import Text
from tq_cli.planning.prepare import plan_source


def _mean_logp(folder: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = model(ids).logits[:, :-1].log_softmax(-1)
    return float(lp.gather(-1, ids[:, 1:, None]).mean())


def test_sampled_sequences_follow_the_model_and_the_seed(tiny_llama: Path) -> None:
    special = {0, 1, 2}
    a = sampled_ids(tiny_llama, 10_000, 3, 40, [5, 6, 7], special, 0, torch.device("cpu"))
    b = sampled_ids(tiny_llama, 10_000, 3, 40, [5, 6, 7], special, 0, torch.device("cpu"))
    c = sampled_ids(tiny_llama, 10_000, 3, 40, [5, 6, 7], special, 1, torch.device("cpu"))
    assert a.shape == (3, 40) and torch.equal(a, b) and not torch.equal(a, c)
    assert a[:, 0].tolist() == [5, 6, 7]
    assert not any(int(t) in special for t in a.view(-1))
    uniform = torch.randint(3, 320, (3, 40), generator=torch.Generator().manual_seed(0))
    # the model's own samples are likelier under it than uniform ids, by a margin
    assert _mean_logp(tiny_llama, a) > _mean_logp(tiny_llama, uniform) + 0.01


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn(tiny_llama: Path) -> None:
    ids = sampled_ids(tiny_llama, 10_000, 2, 30, [5, 6], set(), 0, torch.device("cpu"),
                      vocab=40)
    assert int(ids.max()) < 40


def test_a_model_too_large_for_memory_is_refused(tiny_llama: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_cli.calibration import sampled_tokens
    from tq_cli.errors import UnsupportedError

    monkeypatch.setattr(sampled_tokens, "_available_bytes", lambda: 1 << 30)
    with pytest.raises(UnsupportedError, match=r"needs the whole model in float32 \(2\.0 GiB; "
                       r"1\.0 GiB available\); use random tokens \(drop --self-calib sampled\)"):
        sampled_ids(tiny_llama, 1 << 29, 1, 8, [5], set(), 0, torch.device("cpu"))


def test_the_run_records_what_it_ran_on(tiny_llama: Path, tmp_path: Path) -> None:
    run, record = synthetic_run(plan_source(tiny_llama, None), 64, 3, tmp_path, "cpu",
                                sampled=True)
    assert record["synthetic"] == "model-sampled" and record["tokens"] == run.seqs.numel() == 64
    assert record["seed"] == 3 and len(record["ids_sha256"]) == 64


def test_the_cli_converts_with_sampled_text(tiny_llama: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                                 "--group-size", "32", "--self-calib", "sampled",
                                 "--synthetic-calib", "128", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bits_per_weight"] > 4
    record = read_manifest(tmp_path / "o")["calibration"]
    assert record["synthetic"] == "model-sampled"
    # the studies' helper draws the very ids the conversion ran on
    ids, rec = self_calibration_ids(plan_source(tiny_llama, None), 128, 0, "cpu", sampled=True)
    assert Text(" ".join(map(str, ids.view(-1).tolist())), "").sha256 == record["ids_sha256"]
    assert rec["ids_sha256"] == record["ids_sha256"]


def test_sampled_needs_self_calibration() -> None:
    with pytest.raises(ValueError, match="--self-calib sampled is a kind of self-calibration"):
        ConvertSpec(fast=True, self_calib="sampled")

"""tq eval: window arithmetic, exact self-comparison, sensitivity, encoder metrics, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.evaluation.compare import evaluate, spearman, windows
from tq_cli.evaluation.spec import EvalSpec, parse_sweep, with_rtn
from tq_cli.io.text import Text, calibration_text, evaluation_text
from tq_cli.quant.spec import QuantSpec


@pytest.mark.parametrize(("n", "context", "stride"),
                         [(10, 4, None), (11, 4, None), (10, 4, 2), (100, 16, 5), (3, 8, None),
                          (17, 17, 1)])
def test_windows_score_every_target_once(n: int, context: int, stride: int | None) -> None:
    ws = windows(n, context, stride)
    scored = [t for w in ws for t in range(w.first_target, w.end)]
    assert all(w.end - w.begin <= context and w.first_target > w.begin for w in ws)
    if stride is None:
        # Non-overlapping: the first token of each window is context, never a target.
        assert scored == [t for t in range(1, n) if t % context != 0]
    else:
        assert scored == list(range(1, n))
    assert sum(w.scored for w in ws) == len(scored)


def test_window_errors() -> None:
    with pytest.raises(TqError, match=r"--stride must be between 1 and --context \(8\)"):
        windows(100, 8, 9)
    with pytest.raises(TqError, match="--context must be at least 2"):
        windows(100, 1)


def test_default_text_splits_never_overlap() -> None:
    cal, ev = calibration_text(), evaluation_text()
    assert "evaluation split" in ev.source and "calibration split" in cal.source
    assert cal.text[:2000] not in ev.text and ev.text[:2000] not in cal.text
    assert len(ev.sha256) == 64


def test_spearman() -> None:
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a * 10 + 3) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)


TEXT = Text(" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in
                     range(60)), "test")


def test_model_against_itself_is_exact(tiny_llama: Path) -> None:
    r = evaluate(tiny_llama, str(tiny_llama), TEXT, EvalSpec(context=64, max_tokens=300))
    m = r["metrics"]
    assert m["kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["top1_agreement"] == 1.0
    assert m["candidate_perplexity"] == pytest.approx(m["reference_perplexity"], rel=1e-6)
    assert m["scored_tokens"] == sum(w.scored for w in windows(300, 64))
    assert r["settings"]["scored_tokens"] == m["scored_tokens"]


def test_noise_in_one_layer_shows_up(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    noisy = tmp_path / "noisy"
    shutil.copytree(tiny_llama, noisy)
    name = "model.layers.0.mlp.down_proj.weight"
    index = json.loads((noisy / "model.safetensors.index.json").read_text())
    shard = noisy / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name] + 0.5 * torch.randn_like(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    r = evaluate(noisy, str(tiny_llama), TEXT, EvalSpec(context=64, max_tokens=300))
    assert r["metrics"]["kl_mean"] > 1e-4


def test_encoder_metrics(tiny_bert: Path, tmp_path: Path) -> None:
    text = Text("\n\n".join(f"Paragraph {i} talks about topic {i % 7} at some length, "
                            f"with words {i * 3} and more." for i in range(20)), "test")
    same = evaluate(tiny_bert, str(tiny_bert), text, EvalSpec(context=32))
    assert same["kind"] == "encoder"
    assert same["metrics"]["cosine_min"] == pytest.approx(1.0, abs=1e-5)
    assert same["metrics"]["similarity_spearman"] == pytest.approx(1.0, abs=1e-6)
    out = tmp_path / "bert-tq2"
    convert(tiny_bert, out, ConvertSpec(quant=QuantSpec(bits=2, group_size=32), fast=True))
    q = evaluate(out, None, text, EvalSpec(context=32))
    assert 0.5 < q["metrics"]["cosine_mean"] < 0.9999
    assert q["bits_per_weight"] > 2


def test_cli_json_records_settings(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "tq"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=32)))
    text = tmp_path / "t.txt"
    text.write_text(TEXT.text)
    r = CliRunner().invoke(app, ["eval", str(out), "--text", str(text), "--context", "32",
                                 "--stride", "16", "--max-tokens", "200", "--json",
                                 "--write-card"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    s = data["settings"]
    assert {"context": 32, "stride": 16, "max_tokens": 200}.items() <= s.items()
    assert s["text_source"] == str(text) and len(s["text_sha256"]) == 64
    assert s["scored_tokens"] == 199  # sliding windows score every target once
    assert data["reference"] == str(tiny_llama)
    assert {"reference_perplexity", "candidate_perplexity", "kl_mean",
            "top1_agreement"} <= set(data["metrics"])
    man = json.loads((out / "tq_manifest.json").read_text())
    assert man["eval"][0]["metrics"]["kl_mean"] == data["metrics"]["kl_mean"]
    assert "## Evaluation" in (out / "README.md").read_text()


def test_cli_errors(tmp_path: Path, tiny_llama: Path) -> None:
    r = CliRunner().invoke(app, ["eval", str(tiny_llama)])
    assert r.exit_code == 1 and "not a tq checkpoint, so --reference is needed" in r.stderr
    r = CliRunner().invoke(app, ["eval", str(tiny_llama), "--text", str(tmp_path / "no.txt")])
    assert r.exit_code == 1 and "no such text file" in r.stderr


def test_sweep_grid() -> None:
    combos = parse_sweep("bits=2,3 rotation=none,hadamard group-size=64")
    assert len(combos) == 4 and combos[0] == {"bits": 2, "rotation": "none", "group-size": 64}
    rows = with_rtn(combos)
    assert [r.get("label") for r in rows[:2]] == ["rtn", "rtn"] and len(rows) == 6
    with pytest.raises(TqError, match="unknown key 'colour'"):
        parse_sweep("colour=red")


def test_sweep_cli(tiny_llama: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT.text)
    r = CliRunner().invoke(app, ["eval", str(tiny_llama), "--sweep", "bits=3,4 group-size=32",
                                 "--text", str(text), "--context", "64", "--max-tokens",
                                 "200", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [row["label"] for row in rows] == ["rtn", "rtn", "tq", "tq"]
    kl = {(row["label"], row["settings"]["bits"]): row["metrics"]["kl_mean"] for row in rows}
    assert kl[("tq", 4)] < kl[("tq", 3)]

"""convert --synthetic-calib: data-free calibration from random tokens."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from weighted import weighted_errors

from tq_cli.app import app
from tq_cli.calibration.random_tokens import random_token_ids, synthetic_calibration, synthetic_plan
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.conversion.spec import SELF_CALIB_TOKENS, SELF_CALIB_TOKENS_LOW_BITS
from tq_cli.errors import SourceError
from tq_cli.io.calibration import read_calibration
from tq_cli.io.manifest import read_manifest
from tq_cli.io.safetensors_reader import open_source
from tq_cli.planning import plan as planning_plan
from tq_cli.planning.prepare import plan_source
from tq_cli.quant.spec import QuantSpec

runner = CliRunner()
QUANT = QuantSpec(bits=3, group_size=32)
TOKENS = 1024


def test_synthetic_plan_fits_the_model_positions() -> None:
    assert synthetic_plan(8192, {"max_position_embeddings": 2048}) == (
        synthetic_plan(8192, None))
    p = synthetic_plan(8192, {"max_position_embeddings": 2048})
    assert (p.samples, p.seqlen) == (16, 512)
    p = synthetic_plan(1000, {"max_position_embeddings": 64})
    assert (p.samples, p.seqlen, p.tokens) == (16, 64, 1024)
    p = synthetic_plan(100, {"text_config": {"max_position_embeddings": 4096}})
    assert (p.samples, p.seqlen) == (1, 100)
    with pytest.raises(ValueError):
        synthetic_plan(1, None)


def test_random_ids_skip_special_tokens_and_follow_the_seed() -> None:
    a = random_token_ids(50, {0, 1, 49}, 2000, seed=0)
    assert len(a) == 2000 and not {0, 1, 49} & set(a)
    assert set(a) == set(range(2, 49))  # every ordinary id is drawn
    assert a == random_token_ids(50, {0, 1, 49}, 2000, seed=0)
    assert a != random_token_ids(50, {0, 1, 49}, 2000, seed=1)
    with pytest.raises(SourceError, match="no ordinary tokens"):
        random_token_ids(2, {0, 1}, 10, seed=0)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_bert"])
def test_synthetic_calibration_lowers_the_output_error(model: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    """On a decoder and an encoder: every tensor is quantized GPTQ-style, the manifest
    records what was drawn, and under the random-token Hessians the output error is below
    the plain data-free fit's, tensor by tensor on average and in total."""
    source: Path = request.getfixturevalue(model)
    free, syn = tmp_path / "free", tmp_path / "syn"
    convert(source, free, ConvertSpec(quant=QUANT, device="cpu", fast=True))
    r = convert(source, syn, ConvertSpec(quant=QUANT, device="cpu", synthetic_calib=TOKENS))
    # every tensor but a decoder's head (tq_cli.quant.head: the weight-only fit)
    assert r.calibrated_tensors == r.tensors_converted - (r.head_bits is not None) > 0
    cal = read_manifest(syn)["calibration"]
    src = open_source(source)
    plan = synthetic_plan(TOKENS, src.config)
    assert cal["synthetic"] == "random-tokens" and cal["seed"] == 0
    assert cal["tokens_requested"] == TOKENS and cal["seqlen"] == plan.seqlen
    assert 0 < cal["tokens"] <= plan.tokens and cal["damp"] == 0.01
    assert "calibration" not in read_manifest(free)
    # The same draw again (same seed) for the Hessians the conversion used.
    folder = tmp_path / "again"
    folder.mkdir()
    path, record = synthetic_calibration(plan_source(source, None), TOKENS, 0, folder, "cpu")
    assert record["text_sha256"] == cal["text_sha256"]
    calib = read_calibration(path)
    e_free, e_syn = weighted_errors(free, calib), weighted_errors(syn, calib)
    assert sum(e_syn.values()) < sum(e_free.values())
    assert sum(e_syn[k] < e_free[k] for k in e_free) > len(e_free) // 2


def test_synthetic_calibration_is_reproducible_and_follows_the_seed(tiny_llama: Path,
                                                                    tmp_path: Path) -> None:
    spec = ConvertSpec(quant=QUANT, device="cpu", synthetic_calib=TOKENS)
    convert(tiny_llama, tmp_path / "a", spec)
    convert(tiny_llama, tmp_path / "b", spec)
    seeded = spec.model_copy(update={"rotation": spec.rotation.model_copy(update={"seed": 1})})
    convert(tiny_llama, tmp_path / "c", seeded)
    a, b, c = (read_manifest(tmp_path / x)["calibration"] for x in "abc")
    assert a == b and c["seed"] == 1 and c["text_sha256"] != a["text_sha256"]
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards and all((tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes()
                          for s in shards)


def test_synthetic_calib_cli(tiny_llama: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                            "--bits", "3", "--group-size", "32", "--synthetic-calib", "512",
                            "--act-order", "--json"])
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "o")
    assert m["calibration"]["synthetic"] == "random-tokens"
    assert m["calibration"]["act_order"] is True
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "p"),
                            "--synthetic-calib", "512", "--calib", str(tmp_path / "x.calib")])
    assert r.exit_code == 2 and "--synthetic-calib and --calib are alternatives" in r.output
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "p"),
                            "--synthetic-calib", "-5"])
    assert r.exit_code == 2 and "--synthetic-calib" in r.output
    assert not (tmp_path / "p").exists()


def test_one_convert_plans_the_source_once(tiny_llama: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Source, recipe and plan are made once and shared with the calibration forward (the
    plan twice: once from the headers, once more with where the model's lm_head is)."""
    calls: list[int] = []
    real = planning_plan.make_plan

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("tq_cli.planning.prepare.make_plan", counting)
    convert(tiny_llama, tmp_path / "o", ConvertSpec(quant=QUANT, device="cpu",
                                                    synthetic_calib=256))
    assert len(calls) == 2


def test_synthetic_calib_without_transformers_is_one_line(tiny_llama: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                            "--synthetic-calib", "256"])
    assert r.exit_code == 1
    assert ("--synthetic-calib runs the model on random tokens and needs transformers, which "
            "is not installed: pip install 'tq[models]'") in " ".join(r.output.split())
    assert not (tmp_path / "o").exists()


def test_the_default_self_calibrates_and_the_manifest_says_which_fit(tiny_llama: Path,
                                                                     tmp_path: Path) -> None:
    r = convert(tiny_llama, tmp_path / "default", ConvertSpec(quant=QUANT, device="cpu"))
    assert r.head_bits == 8 and r.warnings == []
    assert r.calibrated_tensors == r.tensors_converted - 1 > 0  # the head: weight-only
    manifest = json.loads((tmp_path / "default" / "tq_manifest.json").read_text())
    assert manifest["calibration"]["synthetic"] == "random-tokens"
    assert manifest["calibration"]["tokens_requested"] == ConvertSpec(
        quant=QUANT).self_calib_tokens
    assert {e["fit"] for e in manifest["tensors"] if e["action"] == "quantize"
            and e["name"] != "lm_head.weight"} == {"gptq"}
    fast = convert(tiny_llama, tmp_path / "fast", ConvertSpec(quant=QUANT, device="cpu",
                                                             fast=True))
    assert fast.calibrated_tensors is None and fast.warnings == []
    manifest = json.loads((tmp_path / "fast" / "tq_manifest.json").read_text())
    assert "calibration" not in manifest
    assert {e["fit"] for e in manifest["tensors"] if e["action"] == "quantize"} == {
        "weight-only"}


def test_without_a_tokenizer_ids_come_from_the_configs_vocabulary(tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    """No tokenizer files: the self-calibrated fit all the same, on ids drawn from
    config.json's vocabulary with the special ids it names left out, said in one line;
    reproducible, and the same run as the default would be."""
    import shutil

    from tq_cli.calibration.random_tokens import special_ids

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    for f in src.glob("tokenizer*"):
        f.unlink()
    cfg = json.loads((src / "config.json").read_text())
    special = special_ids(cfg)
    assert special and special <= {cfg.get("bos_token_id"), cfg.get("eos_token_id"),
                                   cfg.get("pad_token_id")}
    r = convert(src, tmp_path / "out", ConvertSpec(quant=QUANT, device="cpu"))
    assert r.calibrated_tensors == r.tensors_converted - 1 > 0  # the head: weight-only
    [line] = r.warnings
    assert line.startswith("self-calibration drew token ids from config.json's vocabulary "
                           f"({cfg['vocab_size']} ids, special ids {sorted(special)} left "
                           "out), without a tokenizer: ")
    assert "no usable tokenizer" in line
    record = json.loads((tmp_path / "out" / "tq_manifest.json").read_text())["calibration"]
    assert record["synthetic"] == "random-ids"
    assert record["tokens"] == ConvertSpec(quant=QUANT).self_calib_tokens
    # the ids the manifest records are the draw: from the vocabulary, no special id
    ids = random_token_ids(cfg["vocab_size"], special, record["tokens"], seed=0)
    assert hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest() == \
        record["ids_sha256"]
    assert not set(ids) & special and max(ids) < cfg["vocab_size"]
    again = convert(src, tmp_path / "again", ConvertSpec(quant=QUANT, device="cpu"))
    assert again.mean_rel_error == r.mean_rel_error


def test_special_ids_are_read_from_the_config_and_its_text_config() -> None:
    from tq_cli.calibration.random_tokens import special_ids

    cfg = {"eos_token_id": [1, 7], "pad_token_id": None, "image_token_index": 9,
           "use_cache": True, "text_config": {"bos_token_id": 2, "pad_token_id": False}}
    assert special_ids(cfg) == {1, 2, 7, 9}


def test_fast_and_calibration_flags_conflict_on_the_command_line(tiny_llama: Path,
                                                                 tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                                 "--fast", "--synthetic-calib", "64"])
    assert r.exit_code == 2
    assert "--fast skips calibration" in r.stderr


def test_the_default_token_count_follows_the_bits() -> None:
    assert ConvertSpec().self_calib_tokens == SELF_CALIB_TOKENS
    assert ConvertSpec(quant=QuantSpec(bits=3)).self_calib_tokens == SELF_CALIB_TOKENS_LOW_BITS
    assert ConvertSpec(target_bits=3.0).self_calib_tokens == SELF_CALIB_TOKENS_LOW_BITS
    assert ConvertSpec(quant=QuantSpec(bits=3), synthetic_calib=64).self_calib_tokens == 64
    assert ConvertSpec(fast=True).self_calib_tokens == 0
    assert ConvertSpec(synthetic_calib=0).self_calib_tokens == 0


def test_a_model_transformers_does_not_know_falls_back(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "llama_future"}))
    r = convert(src, tmp_path / "out", ConvertSpec(quant=QUANT, device="cpu"))
    assert r.calibrated_tensors is None
    assert any(w.startswith("weight-only fit: tq could not self-calibrate this model (")
               and "does not know model_type 'llama_future'" in w for w in r.warnings)

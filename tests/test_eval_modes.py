"""tq eval's three modes: each flag a mode does not read is refused in one line (exit 2),
each mode's spec validates its flags by type, and the library runs the specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.errors import TqError
from tq_cli.evaluation.compare import reference_for, tokenizer_folder
from tq_cli.evaluation.kv import settings_for
from tq_cli.evaluation.spec import (
    CompareSpec,
    EvalSpec,
    KVEvalSpec,
    NeedleSpec,
    SweepSpec,
    kv_item_bits,
)
from tq_cli.kvcache.spec import KVSpec

runner = CliRunner()
KV_MEASURED = "the KV cache is measured against the same model's full-precision cache"
NEEDLE_ALONE = "(its prompts are generated, --needle-lengths tokens long); add --kv-bits or drop it"

REFUSED = [
    # The comparison's flags in the KV cache mode.
    (["--kv-bits", "4", "--reference", "r"],
     f"--reference does not apply with --kv-bits ({KV_MEASURED}); drop it"),
    (["--kv-bits", "4", "--stride", "16"],
     "--stride does not apply with --kv-bits (each window is prefilled through the cache, "
     "then scored in --kv-chunk chunks); drop it"),
    (["--kv-bits", "4", "--write-card"],
     "--write-card does not apply with --kv-bits (the card records weight evaluations "
     "only); drop it"),
    (["--needle", "--reference", "r"],
     f"--reference does not apply with --needle ({KV_MEASURED}); drop it"),
    (["--needle", "--stride", "8"],
     "--stride does not apply with --needle (each window is prefilled through the cache, "
     "then scored in --kv-chunk chunks); drop it"),
    (["--needle", "--write-card"],
     "--write-card does not apply with --needle (the card records weight evaluations "
     "only); drop it"),
    # ... and in the sweep.
    (["--sweep", "bits=3", "--reference", "r"],
     "--reference does not apply with --sweep (each combination is compared with the "
     "source it was converted from); drop it"),
    (["--sweep", "bits=3", "--write-card"],
     "--write-card does not apply with --sweep (its checkpoints are scratch, deleted "
     "after each row); drop it"),
    # Two modes at once.
    (["--sweep", "bits=3", "--kv-bits", "4"],
     "--sweep and --kv-bits are separate modes of tq eval; run them one at a time"),
    (["--sweep", "bits=3", "--needle"],
     "--sweep and --needle are separate modes of tq eval; run them one at a time"),
    # KV-only, needle-only and sweep-only flags elsewhere.
    (["--kv-window", "8"], "--kv-window applies only with --kv-bits; drop it"),
    (["--no-kv-center-keys"], "--no-kv-center-keys applies only with --kv-bits; drop it"),
    (["--kv-compare", "quanto"], "--kv-compare applies only with --kv-bits; drop it"),
    (["--sweep", "bits=3", "--kv-split", "outlier"],
     "--kv-split applies only with --kv-bits; drop it"),
    (["--needle-lengths", "400"], "--needle-lengths applies only with --needle; drop it"),
    (["--kv-bits", "4", "--needle-seeds", "1"],
     "--needle-seeds applies only with --needle; drop it"),
    (["--sweep", "bits=3", "--needle-seeds", "1"],
     "--needle-seeds applies only with --needle; drop it"),
    (["--no-rtn"], "--no-rtn applies only with --sweep; drop it"),
    (["--kv-bits", "4", "--rtn"], "--rtn applies only with --sweep; drop it"),
    (["--scratch", "/tmp"], "--scratch applies only with --sweep; drop it"),
    # --needle alone tests a full-precision cache on generated prompts.
    (["--needle", "--kv-window", "8"],
     "--kv-window applies only with --kv-bits (--needle alone tests a full-precision "
     "cache); add --kv-bits or drop it"),
    (["--needle", "--kv-chunk", "8"],
     "--kv-chunk applies only with --kv-bits (--needle alone tests a full-precision "
     "cache); add --kv-bits or drop it"),
    (["--needle", "--context", "64"],
     f"--context does not apply with --needle alone {NEEDLE_ALONE}"),
    (["--needle", "--max-tokens", "10"],
     f"--max-tokens does not apply with --needle alone {NEEDLE_ALONE}"),
    (["--needle", "--text", "t.txt"],
     f"--text does not apply with --needle alone {NEEDLE_ALONE}"),
]


@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_a_flag_the_mode_does_not_read_is_refused(flags: list[str], message: str) -> None:
    # Refused before anything is read: the candidate need not exist.
    r = runner.invoke(app, ["eval", "no-such-model", *flags])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"usage error: {message}\n"
    assert r.stdout == ""


INVALID = [
    (["--device", "gpu"],
     "--device: 'gpu' is not one tq runs on; use cpu, cuda (or cuda:N) or auto"),
    (["--context", "64", "--stride", "100"], "--stride: must be at most --context (64), got 100"),
    (["--max-tokens", "-1"], "--max-tokens: Input should be greater than or equal to 0"),
    (["--context", "1"], "--context: Input should be greater than or equal to 2"),
    (["--kv-bits", "4", "--kv-split", "x"], "--kv-split: Input should be 'kv' or 'outlier'"),
    (["--kv-bits", "4", "--kv-rotation", "none"],
     "--kv-rotation: Input should be 'hadamard' or 'orthogonal'"),
    (["--kv-bits", "4", "--kv-sliding", "x"],
     "--kv-sliding: Input should be 'full' or 'quantize'"),
    (["--kv-bits", "4", "--kv-rescale", "x"],
     "--kv-rescale: Input should be 'none', 'norm' or 'unbiased'"),
    (["--kv-bits", "4", "--kv-compare", "foo"], "--kv-compare: Input should be 'quanto' or 'hqq'"),
    (["--kv-bits", "3.5", "--kv-compare", "quanto"],
     "--kv-compare: quanto runs at 2 or 4 bits and no --kv-bits item is 2 or 4; add one or "
     "drop quanto"),
    (["--kv-bits", "4", "--kv-window", "-1"],
     "--kv-window: Input should be greater than or equal to 0"),
    (["--kv-bits", "4", "--kv-sinks", "-1"],
     "--kv-sinks: Input should be greater than or equal to 0"),
    (["--kv-bits", "4", "--kv-chunk", "0"],
     "--kv-chunk: Input should be greater than or equal to 1"),
    (["--kv-bits", "4", "--context", "2"], "--context: Input should be greater than or equal to 3"),
    (["--kv-bits", "4", "--kv-full-layers", "0,b"],
     "--kv-full-layers: Input should be a valid integer, unable to parse string as an integer"),
    (["--kv-bits", "4,z"],
     "--kv-bits: 'z' is not bits (4, 3.5), k<bits>, v<bits> or k<bits>v<bits>"),
    (["--kv-bits", "9"], "--kv-bits: 9: bits must be between 1 and 8, got 9.0"),
    (["--kv-bits", "k9"], "--kv-bits: k9: key_bits must be between 1 and 8, got 9.0"),
    (["--kv-bits", "1", "--kv-qjl"],
     "--kv-bits: 1: qjl needs key_bits >= 2 (b-1 bits of codes plus the 1-bit sketch)"),
    (["--kv-bits", ""],
     "--kv-bits: no cache setting given, e.g. 4,3.5,3 (or the passkey test alone)"),
    (["--kv-bits", "4,,3"], "--kv-bits: an empty item between commas in '4,,3'"),
    (["--kv-bits", "4", "--kv-full-layers", ",0"],
     "--kv-full-layers: an empty item between commas in ',0'"),
    (["--kv-bits", "4", "--kv-attention", "maybe"],
     "--kv-attention: Input should be 'codes' or 'decode'"),
    (["--needle", "--needle-lengths", "400,a"],
     "--needle-lengths: Input should be a valid integer, unable to parse string as an integer"),
    (["--needle", "--needle-lengths", "0"],
     "--needle-lengths: Input should be greater than or equal to 1"),
    (["--needle", "--needle-seeds", "0"],
     "--needle-seeds: must be at least 1 passkey per length and depth, got 0"),
    (["--sweep", "colour=red"],
     "--sweep: unknown key 'colour'; known: bits, codebook, col-scale, group-size, outliers, "
     "rotation, rotation-block, scale-iters, seed, temperature, window-overlap"),
    (["--sweep", "bits=3,5"],
     "--sweep: combination {'bits': 5} is invalid: bits must be 2, 3, 4 or 8, got 5"),
    (["--sweep", "bits"], "--sweep: 'bits' is not key=v1,v2"),
    (["--sweep", "bits=3", "--context", "8", "--stride", "9"],
     "--stride: must be at most --context (8), got 9"),
]


@pytest.mark.parametrize(("flags", "message"), INVALID)
def test_an_invalid_value_is_one_usage_line_naming_the_flag(flags: list[str],
                                                           message: str) -> None:
    r = runner.invoke(app, ["eval", "no-such-model", *flags])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"usage error: {message}\n"


def test_the_specs_are_frozen_typed_and_closed() -> None:
    spec = CompareSpec(context=64, stride=32, reference="ref")
    assert isinstance(spec, EvalSpec) and spec.max_tokens == 8192
    with pytest.raises(ValidationError):
        spec.context = 128  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        CompareSpec(kv_bits="4")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="must be at most --context"):
        EvalSpec(context=8, stride=9)
    assert KVEvalSpec(bits=("4",)).context == 2048  # the KV mode's own default
    with pytest.raises(ValidationError, match="no cache setting given"):
        KVEvalSpec()
    assert KVEvalSpec(needle=NeedleSpec()).bits == ()
    with pytest.raises(ValidationError, match="less than the context minus 1"):
        KVEvalSpec(bits=("4",), context=64, prefill=63)
    assert NeedleSpec(seeds=3).seeds == (0, 1, 2)
    with pytest.raises(ValidationError):
        NeedleSpec(depths=(1.5,))
    sweep = SweepSpec(grid="bits=3,4 group-size=32", context=64)
    assert [c.get("label", "tq") for c in sweep.combinations()] == ["rtn", "rtn", "tq", "tq"]
    assert len(sweep.model_copy(update={"rtn": False}).combinations()) == 2
    from tq_cli.evaluation.spec import to_spec

    specs = [to_spec({k: v for k, v in c.items() if k != "label"})
             for c in sweep.combinations()]
    # the round-to-nearest floor is plain: no column scales (a conversion's default)
    assert [s.quant.col_scale for s in specs] == ["none", "none", "sinkhorn", "sinkhorn"]


def test_kv_items_and_the_settings_a_spec_measures() -> None:
    assert kv_item_bits("3.5") == (4.0, 3.0) and kv_item_bits("3.5", "outlier") == (3.5, 3.5)
    assert kv_item_bits("k4") == (4.0, None) and kv_item_bits("v2.5") == (None, 2.5)
    assert kv_item_bits("k4v3") == (4.0, 3.0)
    with pytest.raises(ValueError, match="'k' is not bits"):
        kv_item_bits("k")
    spec = KVEvalSpec(bits=("4", "k3"), cache=KVSpec(window=8, sinks=0, rotation="orthogonal"))
    settings = settings_for(spec)
    assert [s.label for s in settings] == ["4 (K5/V3)", "k3 (K3/Vfp)"]
    # Every item shares the cache options; its bits are its own.
    assert all(s.spec is not None and s.spec.window == 8 and s.spec.sinks == 0
               and s.spec.rotation == "orthogonal" for s in settings)
    assert settings_for(KVEvalSpec(needle=NeedleSpec())) == []


def _manifest(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tq_manifest.json").write_text(json.dumps({"format_version": 1, **fields}))
    return folder


def test_the_manifest_is_read_through_the_reader(tmp_path: Path, tiny_llama: Path) -> None:
    ck = _manifest(tmp_path / "ck", source={"path": str(tiny_llama)})
    assert reference_for(ck, None) == str(tiny_llama)
    assert tokenizer_folder(ck) == tiny_llama  # no tokenizer of its own: the source's
    newer = _manifest(tmp_path / "newer", format_version=99, source={"path": str(tiny_llama)})
    with pytest.raises(TqError, match="format version 99 is newer than this tq reads"):
        reference_for(newer, None)
    with pytest.raises(TqError, match="format version 99 is newer"):
        tokenizer_folder(newer)
    damaged = _manifest(tmp_path / "damaged")
    with pytest.raises(TqError, match="no source path recorded"):
        reference_for(damaged, None)
    with pytest.raises(TqError, match="not a tq checkpoint, so --reference is needed"):
        reference_for(tiny_llama, None)


def test_write_card_needs_a_tq_checkpoint(tiny_llama: Path) -> None:
    r = runner.invoke(app, ["eval", str(tiny_llama), "--reference", str(tiny_llama),
                            "--write-card"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"error: {tiny_llama}: not a tq checkpoint, so --write-card "
                                "has no card to write to; drop it")
    assert not (tiny_llama / "README.md").exists()


def test_stride_is_refused_for_an_encoder(tiny_bert: Path) -> None:
    r = runner.invoke(app, ["eval", str(tiny_bert), "--reference", str(tiny_bert),
                            "--context", "32", "--stride", "16"])
    assert r.exit_code == 1
    assert "--stride applies to causal LMs; this encoder embeds whole paragraphs" in r.stderr


@pytest.fixture(scope="module")
def tiny_512(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tinymodels import save_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("models") / "tiny-512"
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    save_tiny_tokenizer(folder, 320)
    return folder


def test_needle_alone_reads_no_text(tiny_512: Path) -> None:
    r = runner.invoke(app, ["eval", str(tiny_512), "--needle", "--needle-lengths", "400",
                            "--needle-seeds", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["metrics"] is None and set(data["needle"]) == {"full"}
    assert "text_source" not in data["settings"] and "context" not in data["settings"]
    assert data["settings"]["needle"]["lengths"] == [400]
    r = runner.invoke(app, ["eval", str(tiny_512), "--needle", "--needle-lengths", "10",
                            "--needle-seeds", "1"])
    assert r.exit_code == 1
    assert "--needle-lengths: 10 tokens is too short for a passkey prompt" in r.stderr

"""`tq convert --head-bits`: lm_head (and the input embedding tied to it) stored quantized.

A stored head is the load-time head (`tq_cli.load(..., head_bits=)`, tq_cli.runtime.head)
written into the checkpoint: the same fit, so the two give the same logits bit for bit;
a tied head is stored once, under the embedding's name, and runs as a TQLinear beside a
TQEmbedding that holds the one copy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import tq_cli
from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import UnsupportedError
from tq_cli.runtime.head import TQEmbedding
from tq_cli.runtime.tq_linear import TQLinear

IDS = torch.tensor([[3, 17, 250, 9, 64, 101, 2, 300]])


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinymodels import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tied-llama", tied=True,
                            seed=1, shard="10GB")  # one model.safetensors


def _convert(src: Path, out: Path, head_bits: int | None) -> Path:
    convert(src, out, ConvertSpec(fast=True, head_bits=head_bits))
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "tq_manifest.json").read_text())


@pytest.mark.parametrize("bits", [8, 4])
def test_a_tied_head_is_stored_once_and_equals_the_load_time_head(
        tied_llama: Path, tmp_path: Path, bits: int) -> None:
    plain = _convert(tied_llama, tmp_path / "plain", None)
    stored = _convert(tied_llama, tmp_path / "stored", bits)
    man = _manifest(stored)
    assert man["format_version"] == 3 and _manifest(plain)["format_version"] == 2
    config = json.loads((stored / "config.json").read_text())["quantization_config"]
    assert (config["format_version"], config["head_bits"]) == (3, bits)
    head = next(e for e in man["tensors"] if e["name"] == "model.embed_tokens.weight")
    assert (head["action"], head["module"], head["embedding"], head["head"]) == (
        "quantize", "lm_head", "model.embed_tokens", True)
    assert [e["name"] for e in man["tensors"] if e.get("head")] == [head["name"]]
    assert head["spec"]["bits"] == bits and head["spec"]["outliers"] == 0.0
    assert head["fit"] == "weight-only" and man["guard"] != head["name"]
    index = json.loads((stored / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith("lm_head") for k in index)
    assert "model.embed_tokens.weight" not in index  # only its packed tensors
    assert (sum(f.stat().st_size for f in stored.glob("*.safetensors"))
            < sum(f.stat().st_size for f in plain.glob("*.safetensors")))

    model = tq_cli.load(stored)
    emb, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(lm_head, TQLinear) and isinstance(emb, TQEmbedding)
    assert emb.head is lm_head and emb.weight is lm_head.weight  # one copy
    assert {k for k in model.state_dict() if "embed" in k or "lm_head" in k} == {
        f"model.embed_tokens.weight.{s}"
        for s in ("codes", "scales", "codebook", "outlier_idx", "outlier_val")}
    assert model.tq_report["layers"] == 1 + sum(
        e["action"] == "quantize" for e in _manifest(plain)["tensors"])
    with pytest.raises(UnsupportedError) as refused:
        tq_cli.load(stored, head_bits=8)
    assert str(refused.value) == (f"tq_cli.load: head_bits: {stored} stores lm_head quantized "
                                  f"already ({bits} bits); load it with head_bits=None")
    # the manifest's error is of what is stored (8 bits: after the integer grid's rescale)
    w = load_file(tied_llama / "model.safetensors")["model.embed_tokens.weight"].float()
    rel = float((w - lm_head.dequantize()).pow(2).sum() / w.pow(2).sum())
    assert head["rel_error"] == pytest.approx(rel, rel=1e-4)
    reference = tq_cli.load(plain, head_bits=bits)  # the same fit, made as it loads
    assert torch.equal(_logits(model), _logits(reference))
    assert torch.equal(emb(IDS), reference.get_input_embeddings()(IDS))


def test_an_untied_head_is_an_ordinary_converted_layer(tiny_llama: Path, tmp_path: Path) -> None:
    plain = _convert(tiny_llama, tmp_path / "plain", None)
    stored = _convert(tiny_llama, tmp_path / "stored", 8)
    man = _manifest(stored)
    assert man["format_version"] == 2  # a version 2 reader loads it
    head = next(e for e in man["tensors"] if e["name"] == "lm_head.weight")
    assert head["action"] == "quantize" and head["head"] and "embedding" not in head
    emb = next(e for e in man["tensors"] if e["name"] == "model.embed_tokens.weight")
    assert emb["action"] == "keep"
    model = tq_cli.load(stored)
    assert isinstance(model.lm_head, TQLinear)
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert torch.equal(_logits(model), _logits(tq_cli.load(plain, head_bits=8)))


def test_the_compiled_step_copies_and_moves_keep_one_weight(tied_llama: Path,
                                                            tmp_path: Path) -> None:
    from tq_kernels import cpu

    stored = _convert(tied_llama, tmp_path / "stored", 8)
    eager = tq_cli.load(stored, compile=False)
    twin = copy.deepcopy(eager).to(torch.float32)
    assert twin.get_input_embeddings().weight is twin.get_output_embeddings().weight
    assert twin.get_input_embeddings().weight is not eager.get_output_embeddings().weight
    assert torch.equal(_logits(twin), _logits(eager))
    if not cpu.available():
        pytest.skip("the compiled decode step needs the CPU kernel")
    fast = tq_cli.load(stored, compile=True)
    with torch.no_grad():
        want = eager.generate(IDS, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        got = fast.generate(IDS, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert fast.tq_compiled and torch.equal(got, want)


def test_dequantize_gives_a_tied_plain_model(tied_llama: Path, tmp_path: Path) -> None:
    from tq_cli.runtime.hf_quantizer import dequantize_model

    model = tq_cli.load(_convert(tied_llama, tmp_path / "stored", 8))
    want = _logits(model)
    head = model.get_output_embeddings().dequantize()
    dequantize_model(model)
    emb = model.get_input_embeddings()
    assert type(emb) is torch.nn.Embedding and emb.weight is model.lm_head.weight
    assert torch.equal(emb.weight, head)
    assert torch.allclose(_logits(model), want, atol=1e-4, rtol=1e-4)


def test_a_model_without_a_head_tq_can_store_is_refused(
        tiny_bert: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"--head-bits 8: BertModel has no linear "
                                               r"lm_head; pass --head-bits none$"):
        _convert(tiny_bert, tmp_path / "o", 8)
    assert not (tmp_path / "o").exists()


def test_a_scaled_tied_embedding_is_refused_or_kept(tmp_path: Path) -> None:
    from tinymodels import save_tiny_tokenizer
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64, tie_word_embeddings=True)
    Gemma3ForCausalLM(cfg).save_pretrained(tmp_path / "gemma")
    save_tiny_tokenizer(tmp_path / "gemma", 320)
    with pytest.raises(UnsupportedError, match=(
            r"Gemma3ForCausalLM's lm_head is tied to its input embedding, a "
            r"Gemma3TextScaledWordEmbedding, which tq runs quantized only as a plain "
            r"nn.Embedding; pass --head-bits none$")):
        _convert(tmp_path / "gemma", tmp_path / "o", 8)
    r = convert(tmp_path / "gemma", tmp_path / "kept", ConvertSpec(fast=True))  # the default
    assert r.head_bits is None and any(
        w.startswith("lm_head not quantized (--head-bits): Gemma3ForCausalLM's lm_head is "
                     "tied") for w in r.warnings)


def test_where_the_default_keeps_the_head_it_says_why(tmp_path: Path) -> None:
    """Left at its default, a head tq cannot store is kept with a note (asked for, the
    model is refused: the tests above); a model without one hears nothing."""
    from tinymodels import save_tiny_tokenizer
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=1, num_attention_heads=2)
    BertForMaskedLM(cfg).save_pretrained(tmp_path / "mlm")
    save_tiny_tokenizer(tmp_path / "mlm", 300)
    r = convert(tmp_path / "mlm", tmp_path / "o", ConvertSpec(fast=True))
    assert r.head_bits is None and ("lm_head not quantized (--head-bits): "
                                    "BertForMaskedLM's lm_head, tied to its input embedding, "
                                    "has a bias") in r.warnings
    with pytest.raises(UnsupportedError, match=r"has a bias; pass --head-bits none$"):
        convert(tmp_path / "mlm", tmp_path / "o2", ConvertSpec(fast=True, head_bits=8))


def test_a_tied_weight_stored_under_the_head_name_is_refused(tied_llama: Path,
                                                              tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tied_llama, src)
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedError, match=(
            r"the checkpoint stores LlamaForCausalLM's tied lm_head and input embedding "
            r"under lm_head's name \('lm_head.weight'\); pass --head-bits none$")):
        _convert(src, tmp_path / "o", 8)


def test_the_flag(tied_llama: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(tied_llama), "-o", str(tmp_path / "o"),
                            "--head-bits", "5", "--fast"])
    assert r.exit_code == 2 and "'5' is not 8, 4 or none" in r.stderr, r.stderr
    r = runner.invoke(app, ["convert", str(tied_llama), "-o", str(tmp_path / "kept"),
                            "--head-bits", "None", "--fast", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["head_bits"] is None, r.output
    assert _manifest(tmp_path / "kept")["format_version"] == 2
    r = runner.invoke(app, ["convert", str(tied_llama), "-o", str(tmp_path / "o"),
                            "--head-bits", "8", "--fast", "--json"])
    assert r.exit_code == 0, r.output
    assert _manifest(tmp_path / "o")["format_version"] == 3


def test_self_calibration_leaves_the_head_to_the_weight_only_fit(
        tied_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    convert(tied_llama, out, ConvertSpec(head_bits=8, synthetic_calib=256))
    fits = {e["name"]: e["fit"] for e in _manifest(out)["tensors"] if e["action"] == "quantize"}
    assert fits.pop("model.embed_tokens.weight") == "weight-only"
    assert fits and set(fits.values()) == {"gptq"}
    model = tq_cli.load(out)
    assert torch.isfinite(_logits(model)).all()

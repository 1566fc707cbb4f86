"""A source that is not the model its config.json describes is refused before any compute,
by name; and a checkpoint that transformers would complete with random values is refused
by the loader (tq_cli.runtime.source_check).

Each damaged source is a tiny model saved by transformers with one thing changed, as the
reports that asked for this found them: a parameter's tensor missing (a MoE router, a
whole vision tower), one expert missing or one too many, a layer more than the config
declares, a config whose width disagrees with the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from families import FAMILIES
from safetensors.torch import load_file, save_file

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import CorruptFileError, SourceError
from tq_cli.quant.spec import QuantSpec

SPEC = ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu", fast=True)


def _saved(tmp_path: Path, family: str) -> Path:
    torch.manual_seed(0)
    model, _ = FAMILIES[family]()
    src = tmp_path / "src"
    model.save_pretrained(src)  # one model.safetensors
    return src


def _edit(src: Path, drop: tuple[str, ...] = (), add: dict[str, str] | None = None) -> None:
    """Drop tensors whose names start with any of `drop`; add name -> copy of another."""
    shard = src / "model.safetensors"
    tensors = load_file(shard)
    for name, like in (add or {}).items():
        tensors[name] = tensors[like].clone()
    tensors = {k: v for k, v in tensors.items() if not k.startswith(drop)}
    save_file(tensors, shard, metadata={"format": "pt"})


def _refused(src: Path, tmp_path: Path, spec: ConvertSpec = SPEC) -> str:
    with pytest.raises(SourceError) as e:
        convert(src, tmp_path / "out", spec)
    assert not (tmp_path / "out").exists()
    assert "\n" not in str(e.value)
    suffix = " (--allow-partial converts it anyway)"
    assert str(e.value).endswith(suffix)
    return str(e.value).removesuffix(suffix)


def test_a_missing_parameter_is_refused_by_name(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3")
    _edit(src, drop=("model.layers.1.mlp.down_proj.weight",))
    assert _refused(src, tmp_path) == (
        f"{src / 'config.json'}: the Qwen3ForCausalLM config.json describes has parameter "
        "'model.layers.1.mlp.down_proj.weight', which no tensor of the checkpoint holds "
        "(transformers would initialise it at random); convert the complete original "
        "folder, or fix config.json")


def test_a_missing_router_is_refused(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3_moe")
    _edit(src, drop=("model.layers.0.mlp.gate.weight",))
    assert "has parameter 'model.layers.0.mlp.gate.weight', which no tensor" in \
        _refused(src, tmp_path)


def test_a_renamed_router_is_refused(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3_moe")
    _edit(src, drop=("model.layers.0.mlp.gate.weight",),
          add={"model.layers.0.mlp.router.weight": "model.layers.0.mlp.gate.weight"})
    msg = _refused(src, tmp_path)
    assert msg == (f"{src / 'model.safetensors'}: tensor 'model.layers.0.mlp.router.weight' "
                   "is no parameter of the Qwen3MoeForCausalLM config.json describes, and "
                   "would be dropped on load; fix config.json or remove the tensor")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_experts_that_are_not_the_declared_ones_are_refused(tmp_path: Path,
                                                            change: str) -> None:
    src = _saved(tmp_path, "qwen3_moe")  # 4 experts a layer
    at = "model.layers.1.mlp.experts"
    if change == "missing":
        _edit(src, drop=(f"{at}.3.",))
        want = "the checkpoint has no expert 3 of its 4 for"
    else:
        _edit(src, add={f"{at}.4.{p}.weight": f"{at}.0.{p}.weight"
                        for p in ("gate_proj", "up_proj", "down_proj")})
        want = "the checkpoint has expert 4 beyond the 4 it declares for"
    msg = _refused(src, tmp_path)
    assert want in msg and msg.startswith(f"{src / 'model.safetensors'}: tensor '{at}.")


def test_a_layer_more_than_the_config_says_is_refused(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    cfg["layer_types"] = cfg["layer_types"][:1]
    (src / "config.json").write_text(json.dumps(cfg))
    msg = _refused(src, tmp_path)
    assert "tensor 'model.layers.1." in msg and "(and 10 more) is no parameter" in msg


def test_a_config_wider_than_the_weights_is_refused(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 208
    (src / "config.json").write_text(json.dumps(cfg))
    msg = _refused(src, tmp_path)
    assert msg == (f"{src / 'model.safetensors'}: tensor 'model.layers.0.mlp.down_proj.weight' "
                   "(and 5 more) has shape [96, 200], but the Qwen3ForCausalLM config.json "
                   "describes needs [96, 208] for 'model.layers.0.mlp.down_proj.weight'; fix "
                   "config.json or convert the original folder")


@pytest.mark.parametrize("vision", [False, True])
def test_a_vlm_without_its_vision_tower_is_refused(tmp_path: Path, vision: bool) -> None:
    src = _saved(tmp_path, "llava")
    _edit(src, drop=("vision_tower.",))
    msg = _refused(src, tmp_path, SPEC.model_copy(update={"vision": vision}))
    assert msg.startswith(f"{src / 'config.json'}: the LlavaForConditionalGeneration "
                          "config.json describes has parameter 'model.vision_tower.")


def test_the_loader_refuses_what_transformers_would_initialise(tmp_path: Path) -> None:
    """A checkpoint of a partial source (written with --allow-partial, or by an older tq):
    tq_cli.load and from_pretrained refuse the parameter by name; two loads never differ."""
    src = _saved(tmp_path, "qwen3_moe")
    _edit(src, drop=("model.layers.0.mlp.gate.weight",))
    convert(src, tmp_path / "out", SPEC.model_copy(update={"allow_partial": True}))
    want = (f"{tmp_path / 'out'}: Qwen3MoeForCausalLM has parameter "
            "'model.layers.0.mlp.gate.weight' that the checkpoint does not hold (transformers "
            "would initialise it at random); convert the complete original folder again")
    with pytest.raises(CorruptFileError) as e:
        tq_cli.load(tmp_path / "out", device="cpu")
    assert str(e.value) == want
    import transformers as T

    with pytest.raises(CorruptFileError) as e:
        T.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out")
    assert str(e.value) == want


def test_a_complete_source_passes_and_loads_clean(tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3_moe")
    convert(src, tmp_path / "out", SPEC)
    import transformers as T

    _, info = T.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}


def test_a_converted_weight_answers_as_the_weight(tmp_path: Path) -> None:
    """What family code reads of a layer's weight (Mamba 2 casts by lm_head.weight.dtype):
    the logical shape, the model's dtype and the codes' device."""
    src = _saved(tmp_path, "qwen3")
    convert(src, tmp_path / "out", SPEC)
    model: Any = tq_cli.load(tmp_path / "out", device="cpu", dtype=torch.bfloat16)
    w = model.model.layers[0].mlp.gate_proj.weight
    assert (w.shape, w.dtype, w.device, w.ndim, w.size(0)) == (
        torch.Size([200, 96]), torch.bfloat16, torch.device("cpu"), 2, 200)


def test_a_vision_config_declaring_more_layers_than_the_weights_hold_is_refused(
        tmp_path: Path) -> None:
    src = _saved(tmp_path, "llava")
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"]["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    msg = _refused(src, tmp_path)
    assert msg.startswith(f"{src / 'config.json'}: the LlavaForConditionalGeneration "
                          "config.json describes has parameter 'model.vision_tower.encoder."
                          "layers.2.self_attn.k_proj.weight' (and 15 more), which no tensor")


def test_a_tokenizer_that_needs_a_missing_library_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SigLIP's tokenizer without protobuf raised transformers' ImportError, which tq
    printed as an internal error."""
    import transformers

    from tq_cli.runtime.hf_models import load_tokenizer

    def needs(*_a: Any, **_k: Any) -> None:
        raise ImportError("SiglipTokenizer requires the protobuf library but it was not "
                          "found in your environment.\nCheck out the instructions ...")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs)
    with pytest.raises(SourceError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: the tokenizer needs a library that is not installed (SiglipTokenizer "
        "requires the protobuf library but it was not found in your environment.); pip "
        "install 'tq[models]'")


def test_allow_partial_converts_it_with_a_warning_and_the_loader_still_refuses(
        tmp_path: Path) -> None:
    src = _saved(tmp_path, "qwen3_moe")
    _edit(src, drop=("model.layers.0.mlp.gate.weight",))
    r = convert(src, tmp_path / "out", SPEC.model_copy(update={"allow_partial": True}))
    assert (f"--allow-partial: {src / 'config.json'}: the Qwen3MoeForCausalLM config.json "
            "describes has parameter 'model.layers.0.mlp.gate.weight', which no tensor of the "
            "checkpoint holds (transformers would initialise it at random); a loader will "
            "refuse the checkpoint where it cannot fill that") in r.warnings
    with pytest.raises(CorruptFileError, match=r"'model\.layers\.0\.mlp\.gate\.weight' that the "
                                               r"checkpoint does not hold"):
        tq_cli.load(tmp_path / "out", device="cpu")


def test_a_tied_pair_is_filled_from_either_side(tmp_path: Path) -> None:
    """A tied head stored under lm_head's name only (the embedding absent): transformers
    ties it the other way, so the source is complete."""
    import transformers as T
    from families import TEXT

    from tq_cli.io.safetensors_reader import open_source
    from tq_cli.runtime.module_map import build_in_folder
    from tq_cli.runtime.source_check import source_mismatch

    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(T.Qwen3Config(**TEXT, head_dim=24, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "src")
    _edit(tmp_path / "src", drop=("model.embed_tokens.weight",),
          add={"lm_head.weight": "model.embed_tokens.weight"})
    source = open_source(tmp_path / "src")
    assert source_mismatch(build_in_folder(source.folder, source.config),
                           source.tensors) is None

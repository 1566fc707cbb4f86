"""The family matrix: a tiny model of each family people quantize, converted, loaded, run
and dequantized, with what tq cannot run yet kept in full precision and said so.

Planning asks transformers what it will build (tq_cli.runtime.module_map): renamed
modules (LLaVA's language model) are found, and tensors tq could not load back or run
(a router that is not an nn.Linear, gpt-oss's experts stored as 3-D tensors, the weight
nn.MultiheadAttention reads raw in SigLIP's pooling head) are kept by the built-in
recipes and refused by name when the user's own recipe asks for them. A MoE's experts,
which transformers fuses, run per expert (tests/test_moe.py has the details).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from families import FAMILIES
from weighted import is_head

import tq_cli
from tq_cli.conversion.converter import ConvertResult, ConvertSpec, convert
from tq_cli.errors import UnsupportedError
from tq_cli.quant.spec import QuantSpec
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu

# --fast: the families are about where tensors land; self-calibration is tested below
SPEC = ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu", fast=True)
# What each family keeps although the recipe converts it, and why (the manifest says).
FUSED = ("experts.", "a MoE's experts stored as one 3-D tensor")
TOWER = ("vision", "the vision tower of an image-text model; pass --vision")
PROJECTOR = ("projector", "(the projector)")
RAW = ("head.attention.out_proj", "MultiheadAttention reads it as a raw tensor")
KEPT = {"qwen2_moe": [("mlp.gate.", "Qwen2MoeTopKRouter")],
        "qwen3_moe": [("mlp.gate.", "Qwen3MoeTopKRouter")],
        "olmoe": [("mlp.gate.", "OlmoeTopKRouter")],
        "deepseek_v3": [("mlp.gate.", "DeepseekV3TopkRouter")],
        "jamba": [("router.", "JambaTopKRouter")],
        "qwen3_next": [("mlp.gate.", "Qwen3NextTopKRouter")],
        "glm4_moe": [("mlp.gate.", "Glm4MoeTopkRouter")],
        # an nn.Linear with its own forward stays itself; its experts are 3-D parameters
        "llama4": [("router.", "Llama4Router is an nn.Linear with a forward of its own"),
                   FUSED],
        "t5": [("relative_attention_bias", "'weight' of Embedding")],
        "qwen3_vl": [("visual.", TOWER[1])],
        "gpt_oss": [("router", "GptOssTopKRouter"), FUSED],
        "siglip": [RAW],
        "llava": [TOWER, PROJECTOR], "gemma3_vlm": [TOWER], "mistral3": [TOWER, PROJECTOR],
        "idefics3": [TOWER, ("connector", "(the projector)")],
        "qwen2_5_vl": [("visual.", TOWER[1])]}


def _output(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "image_embeds"):  # CLIP, SigLIP: both towers' embeddings
        return torch.cat([out.image_embeds.flatten(), out.text_embeds.flatten()])
    return out.logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def fp32_products() -> Iterator[None]:
    # The dequantized twin multiplies in float32; so does the kernel here.
    before = cpu.gemm_precision()
    cpu.set_gemm_precision("fp32")
    yield
    cpu.set_gemm_precision(before)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, ConvertResult,
                                                              dict[str, torch.Tensor]]:
    name = request.param
    torch.manual_seed(0)
    model, inputs = FAMILIES[name]()
    src = tmp_path_factory.mktemp(name) / "src"
    model.save_pretrained(src, max_shard_size="200KB")
    out = src.parent / "tq"
    return name, src, out, convert(src, out, SPEC), inputs


def test_each_family_converts_loads_runs_and_dequantizes(family: Any,
                                                         fp32_products: None) -> None:
    _, src, out, result, inputs = family
    # the conversion's own self-check ran (block by block, or the whole small model)
    assert result.self_check is not None and result.self_check["ran"] is True
    assert 0 < max(result.self_check["rel_errors"].values()) < 0.5
    tq = tq_cli.load(out, device="cpu")
    assert tq.tq_report["layers"] == result.tensors_converted > 0
    original = type(tq).from_pretrained(src).eval()
    y, y_ref = _output(tq, inputs), _output(original, inputs)
    assert torch.isfinite(y).all()
    assert _rel(y, y_ref) < 0.5  # 4-bit random weights: near the original, not equal
    twin = tq.dequantize()
    assert not any(isinstance(m, TQLinear) for m in twin.modules())
    assert _rel(_output(twin, inputs), y) < 1e-4  # the kernels compute the stored weights


def test_what_cannot_run_quantized_is_kept_and_said(family: Any) -> None:
    name, _, out, result, _ = family
    manifest = json.loads((out / "tq_manifest.json").read_text())
    kept = {e["name"]: e["kept_because"] for e in manifest["tensors"] if "kept_because" in e}
    if name not in KEPT:
        assert kept == {} and not any("kept in full precision" in w for w in result.warnings)
        return
    assert all(any(part in n and why in w for part, why in KEPT[name]) for n, w in kept.items())
    for part, why in KEPT[name]:
        assert any(part in n for n in kept)
        assert any(w.startswith("kept in full precision") and why in w for w in result.warnings)


def test_renamed_modules_are_recorded(family: Any) -> None:
    name, _, out, _, _ = family
    manifest = json.loads((out / "tq_manifest.json").read_text())
    moved = {e["name"]: e["module"] for e in manifest["tensors"] if "module" in e}
    # Their checkpoints keep transformers 4's names; the loader renames them.
    saved = {"llava": "language_model.model.", "mistral3": "language_model.model.",
             "gemma3_vlm": "language_model.model.", "qwen2_5_vl": "model."}
    experts = {e["name"]: e["expert"] for e in manifest["tensors"] if "expert" in e}
    if name in saved:
        q = f"{saved[name]}layers.0.self_attn.q_proj.weight"
        assert moved[q] == "model.language_model.layers.0.self_attn.q_proj"
        # every converted tensor: 2 layers x 7 projections, and a head stored under a
        # name that is not its module's (a VLM's language_model.lm_head, a tied head)
        heads = [e for e in manifest["tensors"] if is_head(e)]
        assert len(moved) == 14 + sum("module" in e for e in heads)
    elif name == "mixtral":  # block_sparse_moe.experts.3.w1 runs in mlp.experts
        w1 = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
        assert moved[w1] == "model.layers.1.mlp.experts.3.w1"
        assert experts[w1] == {"of": "model.layers.1.mlp.experts", "index": 3, "role": "gate"}
        assert len(moved) == len(experts) == 2 * 4 * 3  # layers x experts x projections
    else:  # a tied head stored under its embedding's name runs as the head (Whisper)
        heads = {e["name"] for e in manifest["tensors"] if is_head(e)}
        assert {n: m for n, m in moved.items() if n not in heads} == {}
    if name in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "jamba", "qwen3_next",
                "glm4_moe"):
        roles = {(e["of"], e["index"], e["role"]) for e in experts.values()}
        assert len(roles) == len(experts) > 0
        assert {r for _, _, r in roles} == {"gate", "up", "down"}
    elif name != "mixtral":
        assert experts == {}


def test_a_vlm_converts_its_vision_tower_on_request(tmp_path: Path,
                                                    fp32_products: None) -> None:
    torch.manual_seed(0)
    model, inputs = FAMILIES["llava"]()
    model.save_pretrained(tmp_path / "src")
    r = convert(tmp_path / "src", tmp_path / "out", SPEC.model_copy(update={"vision": True}))
    manifest = json.loads((tmp_path / "out" / "tq_manifest.json").read_text())
    converted = {e["name"] for e in manifest["tensors"] if e["action"] == "quantize"}
    assert any(n.startswith("vision_tower.") for n in converted)
    assert not any("projector" in n for n in converted)
    tq = tq_cli.load(tmp_path / "out", device="cpu")
    assert tq.tq_report["layers"] == r.tensors_converted
    assert _rel(_output(tq, inputs), _output(model.eval(), inputs)) < 0.5
    # generate() with an image, from the converted checkpoint: the same greedy tokens as
    # its dequantized twin (both multiply in float32).
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ours = tq.generate(**inputs, max_new_tokens=4, do_sample=False)[0, n:]
        twin = tq.dequantize().generate(**inputs, max_new_tokens=4, do_sample=False)[0, n:]
    assert ours.tolist() == twin.tolist() and len(ours) == 4


def test_the_users_recipe_is_refused_by_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, _ = FAMILIES["gpt_oss"]()
    model.save_pretrained(tmp_path / "src")
    recipe = tmp_path / "all.toml"
    recipe.write_text('name = "all"\nskip_non_2d = true\n\n[[rules]]\npattern = "*embed*"\n'
                      'action = "keep"\n\n[[rules]]\npattern = "*.weight"\n')
    spec = SPEC.model_copy(update={"recipe": str(recipe)})
    with pytest.raises(UnsupportedError) as e:
        convert(tmp_path / "src", tmp_path / "out", spec)
    assert str(e.value).endswith(
        "tensor 'model.layers.0.mlp.router.weight' (and 1 more) cannot run quantized (it is "
        "'weight' of "
        "GptOssTopKRouter, not the weight of an nn.Linear); add a keep rule for it to "
        "recipe 'all'")
    assert not (tmp_path / "out").exists()


def test_transformers_loads_it_with_no_missing_or_unexpected_key(family: Any) -> None:
    _, _, out, _, _ = family
    cls = type(tq_cli.load(out, device="cpu"))
    _, info = cls.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}


def test_a_tied_head_is_kept_or_refused(tmp_path: Path) -> None:
    """lm_head tied to the embeddings: transformers shares one tensor, so tq keeps it."""
    import transformers as T
    from families import TEXT

    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(T.Qwen3Config(**TEXT, head_dim=24, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "src")
    recipe = tmp_path / "all.toml"
    recipe.write_text('name = "all"\nskip_non_2d = true\n\n[[rules]]\npattern = "*embed*"\n'
                      'action = "keep"\n\n[[rules]]\npattern = "*.weight"\n')
    # As some hub checkpoints do: the tied head stored under its own name as well.
    from safetensors.torch import load_file, save_file

    shard = tmp_path / "src" / "model.safetensors"
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UnsupportedError, match="tensor 'lm_head.weight' cannot run quantized "
                                               r"\(transformers ties it to "):
        convert(tmp_path / "src", tmp_path / "out",
                SPEC.model_copy(update={"recipe": str(recipe)}))
    assert not (tmp_path / "out").exists()


def test_a_model_with_its_own_code_is_converted_unchecked_and_said(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, _ = FAMILIES["qwen3"]()
    model.save_pretrained(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    r = convert(tmp_path / "src", tmp_path / "out", SPEC)
    assert ("not checked that each converted tensor loads back: the model brings its own "
            "code (auto_map), which tq never runs") in r.warnings


@pytest.mark.parametrize("name", ["llava", "qwen3_moe"])
def test_self_calibration_reaches_renamed_and_fused_layers(tmp_path: Path, name: str) -> None:
    # LLaVA's language model is renamed by transformers' loader, Qwen3-MoE's experts fused:
    # calibration reads the weights and places the taps as the loader does.
    from tinymodels import save_tiny_tokenizer

    torch.manual_seed(0)
    model, _ = FAMILIES[name]()
    model.save_pretrained(tmp_path / "src")
    save_tiny_tokenizer(tmp_path / "src", model.config.get_text_config().vocab_size)
    convert(tmp_path / "src", tmp_path / "out",
            SPEC.model_copy(update={"fast": False, "synthetic_calib": 256}))
    entries = [e for e in json.loads((tmp_path / "out" / "tq_manifest.json").read_text())[
        "tensors"] if e["action"] == "quantize"]
    entries = [e for e in entries if not is_head(e)]  # the head: the weight-only fit
    fell_back = {e["fallback"] for e in entries if not e["calibrated"]}
    assert all(why.startswith("an expert routed") for why in fell_back)
    assert sum(e["calibrated"] for e in entries) >= len(entries) - 6


def test_a_converter_of_a_kept_module_still_loads_it(tmp_path: Path) -> None:
    # NomicBert's checkpoint has attn.Wqkv, which transformers splits into q/k/v when
    # loading (a converter whose pattern names the module). tq keeps it; the converters
    # tq's loader hands transformers must still split it, not leave q/k/v random.
    import transformers as T

    torch.manual_seed(0)
    model = T.NomicBertModel(T.NomicBertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "src")
    r = convert(tmp_path / "src", tmp_path / "out",
                ConvertSpec(quant=QuantSpec(bits=8, group_size=32), fast=True))
    assert r.tensors_converted == 8
    loaded, info = type(model).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values())
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want, got = model(input_ids=ids).last_hidden_state, loaded(input_ids=ids).last_hidden_state
    assert _rel(got, want) < 1e-3


def test_a_low_quantized_share_names_the_largest_kept_tensors(family: Any) -> None:
    """The summary reports the share stored quantized; under 80% of the non-embedding
    weights (Llama 4's experts are 3-D parameters tq keeps), a warning names the largest
    kept tensors and why."""
    name, _, _, result, _ = family
    total, body = result.quantized_share
    assert 0 < total <= 1 and 0 < body <= 1
    low = [w for w in result.warnings if w.startswith("only ")]
    if name in ("llama4", "qwen3_vl", "llava", "gemma3_vlm", "mistral3", "idefics3",
                "qwen2_5_vl", "gpt_oss"):
        assert body < 0.8 and len(low) == 1
        if name == "llama4":
            assert "'model.layers.1.feed_forward.experts.gate_up_proj' [4, 96, 400] (a MoE's " \
                   "experts stored as one 3-D tensor" in low[0]
    else:
        assert body >= 0.8 and low == []

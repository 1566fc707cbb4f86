"""Mixture-of-experts layers run quantized, expert by expert (tq_cli.runtime.experts).

A tiny Mixtral (4 experts, top-2) and Qwen2-MoE are converted at 4 bits. The TQExperts
that replaces transformers' fused experts module must compute the family's own routed
MLP with the stored weights (equal to the original module holding the dequantized
weights), without dequantizing any expert, and only for the experts tokens were routed
to. Calibration taps each expert's input: its Hessian is over the tokens routed to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from families import FAMILIES
from tinymodels import save_tiny_tokenizer

import tq_cli
from tq_cli.calibration.collect import CalibSpec, calibrate
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import UnsupportedError
from tq_cli.io.calibration import read_calibration
from tq_cli.quant.spec import QuantSpec
from tq_cli.runtime.experts import TQExperts, unsupported_because
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu

SPEC = ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu", fast=True)


@pytest.fixture(scope="module")
def fp32_products() -> Any:
    before = cpu.gemm_precision()
    cpu.set_gemm_precision("fp32")
    yield
    cpu.set_gemm_precision(before)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def converted(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    torch.manual_seed(0)
    model, _ = FAMILIES[request.param]()
    src = tmp_path_factory.mktemp(request.param) / "src"
    model.save_pretrained(src)
    save_tiny_tokenizer(src, model.config.vocab_size)
    convert(src, src.parent / "tq", SPEC)
    return request.param, src, src.parent / "tq"


def _experts_layers(model: torch.nn.Module) -> list[TQExperts]:
    return [m for m in model.modules() if isinstance(m, TQExperts)]


def _routing(tokens: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return index, weights


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_experts_compute_the_familys_routed_mlp_with_the_stored_weights(
        converted: tuple[str, Path, Path], fp32_products: None, backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, out = converted
    if backend == "reference":
        monkeypatch.setenv("TQ_FORCE_REFERENCE", "1")
    model = tq_cli.load(out, device="cpu")
    layer = _experts_layers(model)[0]
    x = torch.randn(9, layer.expert(0)["gate"].in_features)
    index, weights = _routing(9, layer.num_experts, 2)
    index[0, 1] = layer.num_experts  # transformers' marker of a masked slot (expert parallel)
    index[3] = index[3, 0]  # one token choosing an expert twice
    assert layer.expert(0)["down"].backend == ("torch" if backend == "reference"
                                                else "cpu-" + cpu.kernel_isa(4, 32))
    with torch.no_grad():
        y = layer(x, index, weights)
        family = layer.dequantize()
        # the family's own loop (from_pretrained picks grouped_mm, which has no masked slot)
        family.config._experts_implementation = "eager"
        reference = family(x, index, weights)
    assert float((y - reference).norm() / reference.norm()) < 1e-5


def test_experts_run_only_the_routed_experts_and_never_dequantize(
        converted: tuple[str, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, out = converted
    model = tq_cli.load(out, device="cpu")
    layer = _experts_layers(model)[0]

    def refuse(self: TQLinear) -> torch.Tensor:
        raise AssertionError("an expert was dequantized in forward")

    monkeypatch.setattr(TQLinear, "dequantize", refuse)
    ran: list[int] = []
    for i in range(layer.num_experts):
        layer.expert(i)["gate"].register_forward_pre_hook(
            lambda _m, _a, i=i: ran.append(i))
    x = torch.randn(3, layer.expert(0)["gate"].in_features)
    index = torch.tensor([[0, 2], [2, 0], [0, 2]])
    with torch.no_grad():
        layer(x, index, torch.full((3, 2), 0.5))
    assert sorted(ran) == [0, 2]  # each routed expert once, for all its tokens


def test_a_converted_moe_loads_in_transformers_and_generates(
        converted: tuple[str, Path, Path], fp32_products: None) -> None:
    out = converted[2]
    model = tq_cli.load(out, device="cpu")
    assert len(_experts_layers(model)) == 2
    plain, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not any(info.values())
    assert len(_experts_layers(plain)) == 2
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=6, do_sample=False)
        b = plain.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_each_experts_hessian_is_over_the_tokens_routed_to_it(
        converted: tuple[str, Path, Path], tmp_path: Path) -> None:
    src = converted[1]
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    calib = tmp_path / "calib.safetensors"
    calibrate(src, calib, CalibSpec(text=str(text), samples=4, seqlen=16, device="cpu"))
    # By hand: the original model on the same sequences, its first MoE layer's routing.
    original = type(tq_cli.load(converted[2], device="cpu")).from_pretrained(src).eval()
    experts = next(m for n, m in original.named_modules() if n.endswith("layers.0.mlp.experts"))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    experts.register_forward_pre_hook(lambda _m, a: seen.append((a[0], a[1])))
    from tq_cli.calibration.collect import token_sequences
    from tq_cli.io.text import read_text
    from tq_cli.runtime.hf_models import load_tokenizer

    seqs = token_sequences(load_tokenizer(src), read_text(str(text)), 4, 16, lambda _: None)
    with torch.no_grad():
        original(input_ids=seqs, use_cache=False)
    hidden, index = seen[0]
    rows = (index == 1).any(-1)
    x = hidden[rows].double()
    expected = x.T @ x / x.shape[0]
    c = read_calibration(calib)
    manifest = json.loads((converted[2] / "tq_manifest.json").read_text())
    gate = next(e["name"] for e in manifest["tensors"]
                if e.get("expert", {}).get("of", "").endswith("layers.0.mlp.experts")
                and e["expert"]["index"] == 1 and e["expert"]["role"] == "gate")
    h = c.hessian(gate)
    assert h is not None and c.tokens(gate) == int(rows.sum())
    assert float((h - expected).norm() / expected.norm()) < 1e-5
    assert gate in c.meta["routed"]


def test_synthetic_calibration_fits_experts_and_says_which_fell_back(
        converted: tuple[str, Path, Path]) -> None:
    _, src, _ = converted
    out = src.parent / "sc"
    result = convert(src, out, SPEC.model_copy(update={"fast": False, "synthetic_calib": 256}))
    entries = [e for e in json.loads((out / "tq_manifest.json").read_text())["tensors"]
               if "expert" in e]
    fit = [e for e in entries if e.get("calibrated")]
    thin = [e for e in entries if not e.get("calibrated")]
    assert fit  # most experts saw enough routed tokens
    for e in thin:
        assert e["fallback"].startswith("an expert routed ")
    if thin:
        assert any(f"{len(thin)} expert projection(s) got the weight-only fit" in w
                   for w in result.warnings)
    assert _experts_layers(tq_cli.load(out, device="cpu"))


def test_a_recipe_converting_some_experts_keeps_the_layers_experts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, _ = FAMILIES["mixtral"]()
    model.save_pretrained(tmp_path / "src")
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "some"\n[[rules]]\npattern = "*.experts.0.*"\naction = "keep"\n'
                      '[[rules]]\npattern = "*experts*"\n')
    with pytest.raises(UnsupportedError, match="converts only some of the 4 experts"):
        convert(tmp_path / "src", tmp_path / "out",
                SPEC.model_copy(update={"recipe": str(recipe)}))


def test_experts_of_another_layout_are_not_taken(fp32_products: None) -> None:
    import transformers as T

    moe = T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1))
    experts = next(m for n, m in moe.named_modules() if n.endswith("mlp.experts"))
    # gpt-oss: biases beside the fused weights
    assert "as other parameters than 3-D gate_up_proj" in (unsupported_because(experts) or "")
    mixtral = next(m for n, m in FAMILIES["mixtral"]()[0].named_modules()
                   if n.endswith("mlp.experts"))
    assert unsupported_because(mixtral) is None
    mixtral.is_transposed = True
    assert unsupported_because(mixtral) == (
        "MixtralExperts's experts have a layout tq does not run quantized (is_transposed "
        "differ from the plain gate/up/down MLP)")


def test_bench_times_a_moe_layer_against_transformers_experts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_cli.bench import moe

    monkeypatch.setattr(moe, "QUICK", {"hidden": 128, "inter": 64, "experts": 4, "top_k": 2})
    monkeypatch.setattr(moe, "BATCHES", (1, 8))
    rows, metrics = moe.run(torch.device("cpu"), quick=True)
    assert [r["batch"] for r in rows] == [1, 8]
    assert all(r[k] > 0 for r in rows for k in ("tq_us", "fp32_us", "bf16_us", "fp32_eager_us"))
    assert sorted(metrics) == sorted(f"moe.cpu.{tag}.4bit.{col}" for tag in ("decode", "prefill8")
                                     for col in ("tq_over_fp32", "tq_over_bf16",
                                                 "tq_over_fp32_eager"))
    assert all(m.kind == "info" for m in metrics.values())

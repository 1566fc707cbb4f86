"""TurboQuant KV cache: codebooks, quantizers, the transformers cache, eval and bench."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.errors import TqError, UnsupportedError
from tq_cli.evaluation.kv import settings_for
from tq_cli.evaluation.spec import KVEvalSpec
from tq_cli.kvcache.cache import TurboQuantCache, fill_from, kv_cache, make_spec, use_kv_cache
from tq_cli.kvcache.codebook import distortion, sphere_codebook
from tq_cli.kvcache.codec import StreamCodec
from tq_cli.kvcache.layers import TurboQuantLayer, TurboQuantSlidingLayer, encode_block
from tq_cli.kvcache.spec import KVSpec, resolve_bits
from tq_cli.quant.codebook import lloyd_max_gaussian
from tq_kernels.packing import packed_row_bytes


def unit(n: int, d: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


# The paper's Theorem 1 table (rounded) and the exact large-d limit, the N(0, 1) quantizer.
PAPER = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_distortion_matches_the_paper(bits: int) -> None:
    assert distortion(128, bits) == pytest.approx(PAPER[bits], rel=0.15)
    assert distortion(4096, bits) == pytest.approx(lloyd_max_gaussian(1 << bits)[1], rel=3e-3)
    # The rotated-coordinate law has lighter tails than its Gaussian limit at small d.
    assert distortion(32, bits) < distortion(128, bits) < distortion(4096, bits)
    levels, _ = sphere_codebook(64, bits)
    assert list(levels) == sorted(levels) and levels[0] == pytest.approx(-levels[-1])


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_quantizer_distortion_is_the_codebooks(bits: int) -> None:
    codec = StreamCodec(64, float(bits), "hadamard", 0, "key")
    x = unit(4000, 64)[None, None]  # [1, 1, T, d]
    err = (codec.decode(codec.encode(x, None), None) - x).pow(2).sum(-1).mean()
    assert float(err) == pytest.approx(distortion(64, bits), rel=0.05)


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_round_trip_error_bound_with_outlier_channels(kind: Any) -> None:
    # Keys have a few huge channels; the rotation spreads them, so the relative error stays
    # near the codebook's distortion whatever the input (the paper's worst-case guarantee).
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 500, 64, generator=gen) * 3 + 1
    x[..., [5, 37]] *= 20
    for bits in (4.0, 3.0, 2.5):
        codec = StreamCodec(64, bits, kind, 0, "key")
        order = codec.choose_channels(x)
        enc = codec.encode(x, order)
        rel = float(((codec.decode(enc, order) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean())
        base = distortion(64, math.floor(bits))
        assert rel < 1.25 * base, (bits, rel, base)
        assert enc["norm" if bits == int(bits) else "norm_hi"].dtype == torch.float16
        if bits != int(bits):
            # The outlier channels (5 and 37) are in the high-precision half of every head.
            assert order is not None and {5, 37} <= set(order[0, :32].tolist())


@pytest.mark.parametrize("bits", range(1, 9))
def test_byte_table_decode_equals_unpacking(bits: int) -> None:
    from tq_cli.kvcache.codec import MSECodec
    from tq_kernels.packing import unpack_codes

    codec = MSECodec(64, bits, "hadamard", 0)
    packed, _, _ = codec.encode(unit(300, 64, seed=bits))
    codes = unpack_codes(packed, bits, 64).long()
    assert torch.equal(codec._levels_of(packed), codec.levels[codes])


def test_codes_and_norms_take_the_bytes_the_format_says() -> None:
    codec = StreamCodec(64, 3.0, "hadamard", 0, "value")
    enc = codec.encode(torch.randn(1, 2, 7, 64), None)
    assert enc["codes"].shape == (1, 2, 7, packed_row_bytes(64, 3)) == (1, 2, 7, 24)
    assert enc["codes"].dtype == torch.uint8 and enc["norm"].shape == (1, 2, 7)


def test_qjl_makes_inner_products_unbiased() -> None:
    # Section 3.2: TurboQuant_mse shrinks <x, x_hat> to 1 - D on average; the QJL sketch
    # of the residual removes that bias.
    x = unit(20000, 64, seed=2)[None, None]
    mse = StreamCodec(64, 2.0, "hadamard", 0, "key")
    prod = StreamCodec(64, 2.0, "hadamard", 0, "key", qjl=True)
    ip_mse = float((mse.decode(mse.encode(x, None), None) * x).sum(-1).mean())
    ip_prod = float((prod.decode(prod.encode(x, None), None) * x).sum(-1).mean())
    assert ip_mse == pytest.approx(1 - distortion(64, 2), abs=0.01)
    assert ip_prod == pytest.approx(1.0, abs=0.01)


def test_bits_policies_and_spec_errors() -> None:
    assert resolve_bits(3.5) == (4.0, 3.0) and resolve_bits(2.5) == (3.0, 2.0)
    assert resolve_bits(4) == (5.0, 3.0) and resolve_bits(3) == (3.0, 3.0)
    assert resolve_bits(2) == (2.0, 2.0) and resolve_bits(8) == (8.0, 8.0)  # the bounds
    assert resolve_bits(3.25) == (3.5, 3.0) and resolve_bits(1.25) == (1.5, 1.0)
    values = [resolve_bits(b / 8)[1] for b in range(8, 65)]
    assert values == sorted(values)  # values never lose bits as the budget grows
    assert all(resolve_bits(b / 8)[0] <= 8 for b in range(8, 65))
    assert resolve_bits(3.5, "outlier") == (3.5, 3.5) and resolve_bits(3, "outlier") == (3, 3)
    with pytest.raises(UnsupportedError, match="key_bits must be between 1 and 8"):
        make_spec(None, key_bits=9)
    with pytest.raises(UnsupportedError, match="qjl needs key_bits >= 2"):
        make_spec(1, qjl=True)
    with pytest.raises(ValidationError, match="'x' is not bits"):
        KVEvalSpec(bits=("4", "x"))
    spec = KVEvalSpec(bits=("3.5", "k4", "v2.5", "k4v3"), cache={"window": 8})
    labels = [s.label for s in settings_for(spec)]
    assert labels == ["3.5 (K4/V3)", "k4 (K4/Vfp)", "v2.5 (Kfp/V2.5)", "k4v3 (K4/V3)"]
    with pytest.raises(ValidationError, match="compare"):
        KVEvalSpec(bits=("4",), compare=("foo",))


def tiny_llama_model(layers: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3_model() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, max_position_embeddings=512, sliding_window=16,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


IDS = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def test_generate_matches_full_precision_when_the_window_covers_everything() -> None:
    model = tiny_llama_model()
    ref = model.generate(IDS, max_new_tokens=16, do_sample=False)
    cache = kv_cache(model, bits=2.5, window=64)
    out = model.generate(IDS, max_new_tokens=16, do_sample=False, cache=cache)
    assert torch.equal(out, ref)
    assert all(isinstance(layer, TurboQuantLayer) for layer in cache.layers)
    assert cache.memory()["code_bytes"] == 0  # nothing left the window
    # With a small window the same call reads codes, and still runs.
    cache = kv_cache(model, bits=2.5, window=4)
    out = model.generate(IDS, max_new_tokens=16, do_sample=False, cache=cache)
    assert out.shape == ref.shape and cache.memory()["code_bytes"] > 0


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every StreamCodec.encode call from here on."""
    sizes: list[int] = []
    original = StreamCodec.encode

    def counting(self: StreamCodec, x: torch.Tensor, order: Any) -> Any:
        sizes.append(x.shape[2])
        return original(self, x, order)

    monkeypatch.setattr(StreamCodec, "encode", counting)
    return sizes


@torch.no_grad()
def test_tokens_are_encoded_once_and_never_requantized(encoded: list[int]) -> None:
    model = tiny_llama_model(layers=1)
    cache = kv_cache(model, bits=3, window=8, sinks=2)
    model(IDS[:, :20], cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    first = {k: v.clone() for k, v in layer.streams[0].store.view().items()}
    for t in range(20, 40):
        model(IDS[:, t:t + 1], cache=cache, use_cache=True)
    # 40 tokens: 2 sinks, 8 in the window, 30 encoded once each (keys and values).
    assert sum(encoded) == 2 * 30
    assert layer.streams[0].store.length == 30 and layer.get_seq_length() == 40
    later = layer.streams[0].store.view()
    for k, v in first.items():
        assert torch.equal(later[k][:, :, :v.shape[2]], v)  # stored codes untouched
    assert torch.equal(layer.streams[0].sinks, layer.streams[0].sinks)


@torch.no_grad()
def test_decode_steps_encode_tokens_in_blocks(encoded: list[int]) -> None:
    model = tiny_llama_model(layers=1)
    assert encode_block(24) == 3 and encode_block(128) == encode_block(4096) == 16
    assert encode_block(8) == encode_block(0) == 1
    cache = kv_cache(model, bits=3, window=24, sinks=2)
    model(IDS[:, :10], cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    for t in range(10, 40):
        model(IDS[:, t:t + 1], cache=cache, use_cache=True)
        recent = layer.streams[0].recent.shape[-2]
        # the window fills to 24, then holds 24..26 tokens; codes leave it 3 at a time
        assert min(t + 1 - 2, 24) <= recent <= 26
        assert layer.streams[0].store.length + recent + 2 == t + 1
    assert set(encoded) == {3} and sum(encoded) == 2 * layer.streams[0].store.length


@torch.no_grad()
def test_prefill_copied_into_a_cache_equals_prefill_through_it() -> None:
    from transformers import DynamicCache

    model = tiny_llama_model()
    spec = make_spec(3, window=8, split="outlier")
    through = TurboQuantCache(spec, model.config)
    model(IDS[:, :30], cache=through, use_cache=True)
    ref = DynamicCache(config=model.config)
    model(IDS[:, :30], cache=ref, use_cache=True)
    copied = fill_from(TurboQuantCache(spec, model.config), ref)
    a = model(IDS[:, 30:], cache=through, use_cache=True).logits
    b = model(IDS[:, 30:], cache=copied, use_cache=True).logits
    assert torch.equal(a, b)


@torch.no_grad()
def test_sliding_layers_full_by_default_or_quantized_inside_their_window() -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = tiny_gemma3_model()
    ref = model.generate(IDS, max_new_tokens=12, do_sample=False)
    default = kv_cache(model, bits=3, window=64)
    assert isinstance(default.layers[0], DynamicSlidingWindowLayer)
    assert isinstance(default.layers[2], TurboQuantLayer)
    quant = kv_cache(model, bits=3, window=64, sliding="quantize")
    assert isinstance(quant.layers[0], TurboQuantSlidingLayer)
    for cache in (default, quant):
        assert torch.equal(model.generate(IDS, max_new_tokens=12, do_sample=False,
                                          cache=cache), ref)
    cache = kv_cache(model, bits=3, window=4, sliding="quantize")
    out = model.generate(IDS, max_new_tokens=12, do_sample=False, cache=cache)
    assert out.shape == ref.shape
    sliding = cache.layers[0]
    assert isinstance(sliding, TurboQuantSlidingLayer) and sliding.streams is not None
    # Same span as transformers' sliding layer: the sliding_window - 1 latest tokens.
    assert sliding.streams[0].tokens == 15 and sliding.streams[0].recent.shape[-2] == 4
    assert cache.layers[2].get_seq_length() == 40 + 11


@torch.no_grad()
def test_full_precision_layers_beams_and_crop() -> None:
    from transformers.cache_utils import DynamicLayer

    model = tiny_llama_model(layers=3)
    cache = kv_cache(model, bits=3, window=4, full_precision_layers=(0, -1))
    assert [type(x) for x in cache.layers] == [DynamicLayer, TurboQuantLayer, DynamicLayer]
    out = model.generate(IDS, max_new_tokens=6, num_beams=2, do_sample=False, cache=cache)
    assert out.shape == (1, 46)
    with pytest.raises(UnsupportedError, match="layer 5 does not exist"):
        kv_cache(model, bits=3, full_precision_layers=(5,))
    cache = kv_cache(model, bits=3, window=4)
    model(IDS, cache=cache, use_cache=True)
    cache.crop(-10)
    assert cache.get_seq_length() == 30
    layer = cache.layers[1]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    # The first token is a full-precision sink (default sinks=1).
    assert layer.streams[0].store.length == 29 and layer.streams[0].recent.shape[-2] == 0
    assert layer.streams[0].sinks.shape[-2] == 1


@torch.no_grad()
def test_memory_counts_codes_norms_window_and_material() -> None:
    model = tiny_llama_model(layers=1)
    cache = kv_cache(model, bits=3, window=8, split="outlier", sinks=0,
                     center_keys=False)
    model(IDS, cache=cache, use_cache=True)
    mem = cache.memory(full_element_bytes=2)
    heads, coded = 2, 40 - 8
    per_vector = packed_row_bytes(32, 3) + 2  # codes + fp16 norm
    assert mem["code_bytes"] == 2 * heads * coded * per_vector
    assert mem["full_bytes"] == 2 * heads * 8 * 32 * 2
    assert mem["elements"] == 2 * heads * 40 * 32
    # Two shared 32x32 float32 rotations plus the two codebooks.
    assert mem["side_bytes"] == 2 * (32 * 32 * 4 + 8 * 4)
    # The defaults: a full-precision sink, and keys centered before RoPE (an fp16 mean per
    # head; which residual each token took rides in its norm's sign, no bytes). Centering
    # values adds their mean too.
    for center, means in ((False, 1), (True, 2)):
        cache = kv_cache(model, bits=3, window=8, split="outlier", center=center)
        model(IDS, cache=cache, use_cache=True)
        layer = cache.layers[0]
        assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
        assert (layer.streams[1].mean is not None) == center
        m = cache.memory(full_element_bytes=2)
        assert m["code_bytes"] == 2 * heads * (coded - 1) * per_vector
        assert m["full_bytes"] == 2 * heads * 9 * 32 * 2
        assert m["side_bytes"] == mem["side_bytes"] + means * heads * 32 * 2
    assert mem["bits_per_element"] == pytest.approx(8 * mem["total_bytes"] / mem["elements"])


@torch.no_grad()
def test_default_generate_cache_and_load_kv_bits(tiny_llama: Path, tmp_path: Path) -> None:
    import tq_cli
    from tq_cli.conversion.converter import ConvertSpec, convert

    model = use_kv_cache(tiny_llama_model(), KVSpec(key_bits=3, value_bits=3, window=4))
    out = model.generate(IDS, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, TurboQuantCache)
    assert isinstance(model.generate(IDS, max_new_tokens=2, do_sample=False,
                                     return_dict_in_generate=True,
                                     cache=kv_cache(model, 4)).cache, TurboQuantCache)
    ck = tmp_path / "tq"
    convert(tiny_llama, ck, ConvertSpec())
    with pytest.raises(TqError, match=r"^tq_cli\.load: kv_bits: Input should be less than or "
                                      "equal to 8$"):
        tq_cli.load(ck, device="cpu", kv_bits=12)
    loaded = tq_cli.load(ck, device="cpu", kv_bits=3.5)
    assert loaded.tq_kv_spec.key_bits == 4 and loaded.tq_kv_spec.value_bits == 3
    out = loaded.generate(IDS[:, :20], max_new_tokens=3, do_sample=False,
                          return_dict_in_generate=True)
    assert isinstance(out.cache, TurboQuantCache)


def test_eval_kv_cli(tiny_llama: Path) -> None:
    runner = CliRunner()
    args = ["eval", str(tiny_llama), "--kv-bits", "4,2.5,k3,v3", "--context", "64",
            "--max-tokens", "200", "--kv-window", "8", "--kv-chunk", "8"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    m = r["metrics"]
    # 200 tokens: three windows of 64 (the last 8 tokens cannot fill a prefill).
    assert m["windows"] == 3 and m["prefill"] == 32 and m["scored_tokens"] == 3 * 31
    rows = {row["label"]: row for row in m["rows"]}
    assert rows["4 (K5/V3)"]["kl_mean"] < rows["2.5 (K3/V2)"]["kl_mean"]
    assert rows["k3 (K3/Vfp)"]["value_rel_error"] is None
    assert 0 < rows["4 (K5/V3)"]["key_rel_error"] < 0.02
    assert all(2 < row["bits_per_element"] < 16 for row in m["rows"])
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "K/V err" in res.stdout
    res = runner.invoke(app, ["eval", str(tiny_llama), "--kv-bits", "9"])
    assert res.exit_code == 2
    assert res.stderr == "usage error: --kv-bits: 9: bits must be between 1 and 8, got 9.0\n"
    res = runner.invoke(app, ["eval", str(tiny_llama), "--kv-bits", "4", "--kv-split", "x"])
    assert res.exit_code == 2 and "--kv-split: Input should be 'kv' or 'outlier'" in res.stderr
    res = runner.invoke(app, ["eval", str(tiny_llama), "--kv-bits", "4", "--kv-rescale", "x"])
    assert res.exit_code == 2
    assert "--kv-rescale: Input should be 'none', 'norm' or 'unbiased'" in res.stderr
    # The defaults (keys centered, one sink, norm scale) and turning them off.
    spec = rows["4 (K5/V3)"]["spec"]
    assert (spec["center_keys"], spec["sinks"], spec["rescale"]) == (True, 1, "norm")
    res = runner.invoke(app, [*args[:3], "4", *args[4:], "--no-kv-center-keys", "--kv-sinks",
                              "0", "--kv-rescale", "none", "--json"])
    assert res.exit_code == 0, res.output
    spec = json.loads(res.stdout)["metrics"]["rows"][0]["spec"]
    assert (spec["center_keys"], spec["sinks"], spec["rescale"]) == (False, 0, "none")


def test_needle_cli(tmp_path: Path) -> None:
    from tinymodels import save_tiny_tokenizer

    folder = tmp_path / "tiny-512"
    tiny_llama_model().save_pretrained(folder)
    save_tiny_tokenizer(folder, 320)
    res = CliRunner().invoke(app, ["eval", str(folder), "--needle", "--kv-bits", "3",
                                   "--needle-lengths", "400", "--needle-seeds", "1",
                                   "--kv-window", "8", "--max-tokens", "100",
                                   "--context", "100", "--json"])
    assert res.exit_code == 0, res.output
    needle = json.loads(res.stdout)["needle"]
    assert set(needle) == {"full", "3 (K3/V3)"}
    assert needle["full"]["total"] == 5 and len(needle["full"]["cases"][0]["passkey"]) == 5


def test_needle_prompt_places_the_key_at_depth() -> None:
    from transformers import AutoTokenizer

    from tq_cli.demo_model import smollm2_folder
    from tq_cli.evaluation.needle import make_case

    try:
        tok = AutoTokenizer.from_pretrained(smollm2_folder())
    except (TqError, OSError):
        pytest.skip("SmolLM2 tokenizer not available offline")
    for depth in (0.1, 0.9):
        case = make_case(tok, 2048, depth, 0, 5)
        text = tok.decode(case.context)
        assert abs(len(case.context) + len(case.question) - 2048) < 20
        where = text.index(f"The pass key is {case.passkey}") / len(text)
        assert abs(where - depth) < 0.05


def test_transformers_baseline_bits() -> None:
    pytest.importorskip("optimum.quanto")
    from tq_cli.evaluation.kv_baselines import hf_cache_bits, hf_quantized_cache

    model = tiny_llama_model(layers=1)
    cache = hf_quantized_cache(model, "quanto", 4, residual_length=8)
    with torch.no_grad():
        model(IDS, cache=cache, use_cache=True)
    assert hf_cache_bits(cache) == pytest.approx(4 + 32 / 64)
    with pytest.raises(UnsupportedError, match="3 bits is not supported"):
        hf_quantized_cache(model, "quanto", 3, 8)


def test_bench_kv_section() -> None:
    from tq_cli.bench import kv

    rows, metrics = kv.run(torch.device("cpu"), quick=True)
    mem = [r for r in rows if r["table"] == "memory"]
    assert {r["context"] for r in mem} == set(kv.QUICK_CONTEXTS)
    for r in mem:
        assert r["vs_bf16"] > 3 and r["bytes_per_token"] < r["bf16_bytes_per_token"]
    assert any(name.startswith("kv.memory.") for name in metrics)


def test_errors_of_quantized_streams_are_reported() -> None:
    model = tiny_llama_model(layers=1)
    cache = kv_cache(model, bits=4, window=4, measure_error=True, key_bits=None,
                     value_bits=4)
    with torch.no_grad():
        model(IDS, cache=cache, use_cache=True)
    err = cache.errors()
    assert math.isnan(err["key"]) and 0 < err["value"] < 0.02
    with pytest.raises(TqError):
        make_spec(3, window=-1)

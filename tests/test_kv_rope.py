"""Keys centered before RoPE (`tq_cli.kvcache.rope`): the angles match transformers', the
offset is taken out and added back at the right positions through decode, crop and a
sliding window, and a key far from the mean is coded as it is."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tq_cli.kvcache.cache import kv_cache
from tq_cli.kvcache.layers import TurboQuantLayer
from tq_cli.kvcache.rope import RotaryAngles, inv_freq_for

D, HEADS = 32, 2


def llama_config(**extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                       num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=HEADS, head_dim=D, max_position_embeddings=4096,
                       **extra)


def apply_rope(config: Any, x: torch.Tensor, start: int) -> torch.Tensor:
    """transformers' own RoPE of x [B, H, T, d] at positions start.."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    pos = torch.arange(start, start + x.shape[-2])[None]
    cos, sin = LlamaRotaryEmbedding(config)(x, pos)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 512}])
def test_angles_are_transformers_rope(rope: dict[str, Any] | None) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = llama_config(**({"rope_parameters": rope} if rope else {}))
    inv = inv_freq_for(cfg, "full_attention", D)
    assert inv is not None
    emb = LlamaRotaryEmbedding(cfg)
    assert torch.allclose(inv, emb.inv_freq)
    angles = RotaryAngles(inv)
    k = torch.randn(1, HEADS, 9, D)
    turned = apply_rope(cfg, k, 100) / emb.attention_scaling
    assert torch.allclose(angles.unrotate(turned, 100), k, atol=1e-5)
    m = torch.randn(1, HEADS, 1, D)
    assert torch.allclose(angles.offsets(m, 100, 9),
                          apply_rope(cfg, m.expand(1, HEADS, 9, D), 100)
                          / emb.attention_scaling, atol=1e-5)


def test_angles_per_layer_type_and_configs_without_rope() -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=D, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"])
    emb = Gemma3ForCausalLM(cfg).model.rotary_emb
    for kind in ("sliding_attention", "full_attention"):
        inv = inv_freq_for(cfg, kind, D)
        assert inv is not None and torch.allclose(inv, getattr(emb, f"{kind}_inv_freq"))
    assert not torch.allclose(inv_freq_for(cfg, "sliding_attention", D),  # type: ignore[arg-type]
                              inv_freq_for(cfg, "full_attention", D))  # type: ignore[arg-type]
    # No RoPE tq reads (absolute positions, an unknown type): keys are coded uncentered.
    assert inv_freq_for(SimpleNamespace(n_embd=64), "full_attention", D) is None
    odd = llama_config(rope_parameters={"rope_type": "nope", "rope_theta": 1e4})
    assert inv_freq_for(odd, "full_attention", D) is None


def spread_keys(n: int, seed: int = 0) -> torch.Tensor:
    """Keys before RoPE like a Llama's: a large per-channel offset plus a small spread."""
    g = torch.Generator().manual_seed(seed)
    mean = 4 * torch.randn(1, HEADS, 1, D, generator=g)
    return mean + 0.5 * torch.randn(1, HEADS, n, D, generator=g)


def offset_keys(config: Any, n: int) -> torch.Tensor:
    return apply_rope(config, spread_keys(n), 0)


def feed(cache: Any, keys: torch.Tensor, prefill: int, step: int = 1) -> torch.Tensor:
    """Prefill, then `step` tokens per update; the keys the last update returned."""
    values = torch.randn_like(keys)
    out = cache.update(keys[..., :prefill, :], values[..., :prefill, :], 0)[0]
    for t in range(prefill, keys.shape[-2], step):
        out = cache.update(keys[..., t:t + step, :], values[..., t:t + step, :], 0)[0]
    return out


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum())


@torch.no_grad()
def test_centering_codes_the_spread_and_decodes_at_the_right_positions() -> None:
    cfg = llama_config()
    keys = offset_keys(cfg, 120)
    plain = kv_cache(cfg, key_bits=3, value_bits=None, window=8,
                     center_keys=False, sinks=0)
    centered = kv_cache(cfg, key_bits=3, value_bits=None, window=8, center_keys=True,
                       sinks=0, measure_error=True)
    got_plain, got = feed(plain, keys, 40), feed(centered, keys, 40)
    layer = centered.layers[0]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    assert layer.streams[0].mean is not None and layer.streams[0].store.length == 112
    # What every update returned, decoded from codes at their positions, not only what
    # was measured at encode time: wrong positions would leave the offset in the error.
    e_plain, e = rel_error(got_plain, keys), rel_error(got, keys)
    assert e < e_plain / 10
    # Decoded at read time as at encode time (where the error was measured). The last
    # update read 111 tokens from codes; the 112th was still in the window.
    stream = layer.streams[0]
    now = stream.decoded(stream.store.view(), stream.store_pos)
    assert centered.errors()["key"] == pytest.approx(rel_error(now, keys[..., :112, :]),
                                                    rel=1e-5)
    assert torch.allclose(got[..., :111, :], now[..., :111, :])
    # Same bytes: the mean per head is all centering adds.
    mp, mc = plain.memory(), centered.memory()
    assert mc["code_bytes"] == mp["code_bytes"]
    assert mc["side_bytes"] == mp["side_bytes"] + HEADS * D * 2


@torch.no_grad()
def test_positions_survive_crop_and_a_sliding_window() -> None:
    from transformers import Gemma3TextConfig

    cfg = llama_config()
    keys = offset_keys(cfg, 80)
    cache = kv_cache(cfg, key_bits=3, value_bits=None, window=4, center_keys=True, sinks=0)
    feed(cache, keys[..., :60, :], 30, step=3)
    cache.crop(-20)  # drops 4 from the window and 16 codes: positions 40..59
    got = feed(cache, keys[..., 40:, :], 5)
    assert got.shape[-2] == 80 and rel_error(got, keys) < 0.01

    gem = Gemma3TextConfig(vocab_size=320, hidden_size=128, intermediate_size=200,
                           num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=HEADS, head_dim=D, sliding_window=24,
                           layer_types=["sliding_attention"])
    inv = inv_freq_for(gem, "sliding_attention", D)
    assert inv is not None
    keys = RotaryAngles(inv).rotate(spread_keys(100), 0)  # Gemma's local RoPE
    cache = kv_cache(gem, key_bits=3, value_bits=None, window=4, center_keys=True,
                     sliding="quantize")
    got = feed(cache, keys, 10, step=2)
    assert got.shape[-2] == 23 + 2  # the sliding_window - 1 kept and the 2 new
    assert rel_error(got, keys[..., -25:, :]) < 0.05


@torch.no_grad()
def test_a_key_far_from_the_mean_is_coded_as_it_is() -> None:
    cfg = llama_config()
    keys = offset_keys(cfg, 40)
    keys[..., 0, :] = -3 * keys[..., 0, :]  # an attention sink: nowhere near the mean
    cache = kv_cache(cfg, key_bits=3, value_bits=None, window=4, center_keys=True, sinks=0)
    feed(cache, keys, 40)
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    stream = layer.streams[0]
    norms = stream.store.view()["norm"]
    assert bool(torch.signbit(norms[..., 0]).all())  # coded as it is
    assert not bool(torch.signbit(norms[..., 1:]).any())  # the rest centered
    # Token 0 decodes exactly as the uncentered codec codes it.
    own = stream.codec.decode(stream.codec.encode(keys[..., :1, :], None), None)
    assert torch.allclose(stream.decoded(stream.store.view(), 0)[..., :1, :], own, atol=1e-5)


def test_partial_rotary_leaves_the_other_channels_alone() -> None:
    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                           "partial_rotary_factor": 0.5})
    inv = inv_freq_for(cfg, "full_attention", D)
    assert inv is not None and inv.numel() == D // 4
    angles = RotaryAngles(inv)
    x = torch.randn(1, HEADS, 7, D)
    turned = angles.rotate(x, 3)
    assert torch.equal(turned[..., D // 2:], x[..., D // 2:])
    assert torch.allclose(angles.unrotate(turned, 3), x, atol=1e-5)
    m = torch.randn(1, HEADS, 1, D)
    assert torch.allclose(angles.offsets(m, 3, 7), angles.rotate(m.expand(1, HEADS, 7, D), 3))


@torch.no_grad()
def test_angles_wider_than_the_keys_leave_them_uncentered() -> None:
    cfg = llama_config()
    cache = kv_cache(cfg, key_bits=3, value_bits=None, window=4, sinks=0)
    keys = torch.randn(1, HEADS, 20, D // 2)  # narrower than the config's head_dim
    got = feed(cache, keys, 10)
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantLayer) and layer.streams is not None
    assert layer.streams[0].rope is None and layer.streams[0].mean is None
    assert got.shape == keys.shape and rel_error(got, keys) < 0.1

"""Attention on the KV codes (tq_cli.kvcache.attend) against the reference path that
decodes every coded token first: same logits, every option of the cache, and no coded
token ever decoded in a decode step."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import tq_cli
import tq_cli.kvcache.attend as attend
from tq_cli.errors import UnsupportedError
from tq_cli.kvcache.codec import StreamCodec
from tq_cli.kvcache.rope import RotaryAngles


def _model(kind: str = "llama", head_dim: int = 32, heads: int = 4, kv_heads: int = 2,
           layers: int = 2, partial: float | None = None) -> Any:
    import transformers as T

    cfg_cls, model_cls, extra = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {}),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"pad_token_id": 0}),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {}),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, {}),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
        "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, {}),
        "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, {}),
        "cohere": (T.CohereConfig, T.CohereForCausalLM, {}),
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4}),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                      {"num_experts": 4, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32}),
    }[kind]
    extra = {**extra, "bos_token_id": None, "eos_token_id": None}
    if partial is not None:
        extra["partial_rotary_factor"] = partial
    cfg = cfg_cls(vocab_size=200, hidden_size=heads * head_dim, intermediate_size=96,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=4096, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(cfg).eval()


@torch.no_grad()
def _decode(model: Any, cache: Any, ids: torch.Tensor, steps: int,
            mask: torch.Tensor | None = None,
            fed: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of `steps` decode steps after a prefill of `ids`, and the tokens fed: the
    greedy ones, or `fed` (so two paths read the same tokens even where a near tie would
    make their argmax differ)."""
    out = model(ids, cache=cache, use_cache=True, attention_mask=mask)
    nxt = out.logits[:, -1:].argmax(-1)
    logits, tokens = [], []
    for i in range(steps):
        if fed is not None:
            nxt = fed[i]
        tokens.append(nxt)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        o = model(nxt, cache=cache, use_cache=True, attention_mask=mask)
        logits.append(o.logits)
        nxt = o.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1), tokens


def _both(model: Any, ids: torch.Tensor, steps: int = 6, mask: torch.Tensor | None = None,
          **opts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ref, fed = _decode(model, tq_cli.kv_cache(model, code_attention=False, **opts), ids,
                       steps, mask)
    cache = tq_cli.kv_cache(model, code_attention=True, **opts)
    assert cache.code_attention and model.config._attn_implementation == attend.NAME
    return ref, _decode(model, cache, ids, steps, mask, fed)[0]


def _close(ref: torch.Tensor, got: torch.Tensor) -> None:
    err = float((ref - got).abs().max())
    assert err <= 1e-5 * float(ref.abs().max()) + 1e-6, err


@pytest.mark.parametrize("opts", [
    {"bits": 3.5}, {"bits": 4}, {"bits": 3}, {"bits": 2.5}, {"bits": 2},
    {"bits": 3.5, "qjl": True}, {"bits": 3, "center": True},
    {"bits": 4.5, "split": "outlier"}, {"bits": 3.5, "center_keys": False},
    {"bits": 3.5, "sinks": 0}, {"bits": 3.5, "sinks": 4, "window": 0},
    {"bits": 3.5, "rotation": "orthogonal", "rescale": "unbiased"},
])
def test_code_attention_gives_the_decoding_paths_logits(opts: dict) -> None:
    model = _model()
    ids = torch.randint(0, 200, (2, 90), generator=torch.Generator().manual_seed(1))
    ref, got = _both(model, ids, window=opts.pop("window", 16), **opts)
    _close(ref, got)


@pytest.mark.parametrize("listed", [True, False])
def test_keys_coded_uncentered_listed_or_checked(monkeypatch: pytest.MonkeyPatch,
                                                 listed: bool) -> None:
    """Keys centered before RoPE: the mean term is taken back for each token coded as it
    was, whether the cache lists those tokens or attention checks every stored norm."""
    import tq_cli.kvcache.layers as layers

    monkeypatch.setattr(layers, "_listed", lambda n, length: listed)
    model = _model()
    ids = torch.randint(0, 200, (2, 90), generator=torch.Generator().manual_seed(1))
    cache = tq_cli.kv_cache(model, bits=3.5, window=16, code_attention=True)
    model(ids, cache=cache, use_cache=True)
    k = cache.layers[0].streams[0]
    assert 0 < len(k.uncentered) < k.store.length  # both kinds of token are in view
    coded = k.coded()
    assert (coded.uncentered is not None) == listed
    _close(*_both(model, ids, bits=3.5, window=16))


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"),
                         [(64, 2, 2), (128, 4, 1), (256, 2, 1), (16, 8, 1)])
def test_head_dims_and_gqa_ratios(head_dim: int, heads: int, kv_heads: int) -> None:
    model = _model(head_dim=head_dim, heads=heads, kv_heads=kv_heads, layers=1)
    ids = torch.randint(0, 200, (1, 70), generator=torch.Generator().manual_seed(2))
    _close(*_both(model, ids, bits=3.5, window=8))


@pytest.mark.parametrize("batch", [1, 4])
def test_left_padding_and_batches(batch: int) -> None:
    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 200, (batch, 80), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :23] = 0  # the last row is left-padded
    _close(*_both(model, ids, mask=mask, bits=3.5, window=8))


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3", "phi3", "gemma", "granite",
                                  "olmo2", "stablelm", "starcoder2", "cohere", "mixtral",
                                  "qwen2_moe"])
def test_other_families(kind: str) -> None:
    """Every family that runs sdpa and hands attention the cache's keys as they are
    attends on the codes (each layer's probe met), with the decoding path's logits."""
    model = _model(kind)
    ids = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(4))
    ref, fed = _decode(model, tq_cli.kv_cache(model, code_attention=False, bits=3.5,
                                              window=8), ids, 6)
    cache = tq_cli.kv_cache(model, code_attention=True, bits=3.5, window=8)
    got = _decode(model, cache, ids, 6, fed=fed)[0]
    assert [layer.probe.state for layer in cache.layers] == ["seen", "seen"]
    _close(ref, got)


def test_partial_rotary_keys() -> None:
    model = _model(partial=0.5)
    ids = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(5))
    _close(*_both(model, ids, bits=3.5, window=8))


def test_no_coded_token_is_decoded_in_a_decode_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    cache = tq_cli.kv_cache(model, bits=3.5, window=8)
    ids = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)

        def refuse(*_: Any, **__: Any) -> torch.Tensor:
            raise AssertionError("a coded token was decoded")

        monkeypatch.setattr(StreamCodec, "decode", refuse)
        model(ids[:, -1:], cache=cache, use_cache=True)  # runs on the codes
        with pytest.raises(AssertionError, match="decoded"):
            model(ids[:, -9:], cache=cache, use_cache=True)  # 9 new tokens: decodes


def test_mean_scores_is_the_turned_mean() -> None:
    """<q, R(p) m> by angle addition equals forming R(p) m, at a large start position."""
    g = torch.Generator().manual_seed(7)
    inv = 1.0 / (10000 ** (torch.arange(0, 24, 2, dtype=torch.float32) / 24))
    rope = RotaryAngles(inv)  # 24 of 32 channels rotate
    q = torch.randn(2, 3, 5, 32, generator=g)
    mean = torch.randn(1, 3, 1, 32, generator=g)
    want = torch.einsum("bhmd,bhnd->bhmn", q, rope.offsets(mean, 1000, 200).expand(2, -1, -1,
                                                                                      -1))
    got = attend.mean_scores(q, mean, rope, 1000, 200)
    assert torch.allclose(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)


def test_a_module_that_changes_the_keys_decodes_first(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A family whose attention module hands attention a copy of the cache's keys (here
    every module, through a wrapped attention function) would attend on the window alone:
    each layer's probe is not met, so it decodes first, with the decoding path's logits."""
    from transformers import AttentionInterface

    real = attend.attention

    def copying(module: Any, query: torch.Tensor, key: torch.Tensor, *a: Any,
                **kw: Any) -> Any:
        return real(module, query, key.clone(), *a, **kw)

    monkeypatch.setattr(attend, "attention", copying)  # what register() installs
    monkeypatch.setattr(attend, "_said", set())
    model = _model()
    ids = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(4))
    try:
        with caplog.at_level(logging.INFO, logger="tq"):
            ref, fed = _decode(model, tq_cli.kv_cache(model, code_attention=False, bits=3.5,
                                                      window=8), ids, 4)
            cache = tq_cli.kv_cache(model, code_attention=True, bits=3.5, window=8)
            got = _decode(model, cache, ids, 4, fed=fed)[0]
    finally:
        AttentionInterface.register(attend.NAME, real)
    assert [layer.probe.state for layer in cache.layers] == ["refused", "refused"]
    assert torch.equal(ref, got)
    assert "changes the cache's keys before the attention function" in caplog.text


def test_attention_arguments_it_does_not_read_refuse_the_codes() -> None:
    """Sinks passed to attention (gpt-oss's s_aux), a sliding window or attention weights
    asked for: tq's attention would ignore them, so the layer keeps decoding first."""
    for kwargs, state in (({"s_aux": torch.zeros(2)}, "refused"),
                          ({"sliding_window": 128}, "refused"),
                          ({"output_attentions": True}, "refused"),
                          ({"sliding_window": None, "softcap": 50.0, "position_ids": 3}, "seen")):
        probe = attend.KeysProbe()
        assert probe.offer() and probe.offer() and probe.state == "offered"  # offered again
        probe.met(kwargs)
        assert probe.state == state, kwargs
        assert not probe.offer()  # settled
        probe.missed()
        assert probe.state == state


def test_an_eager_model_keeps_the_decoding_path() -> None:
    """tq's attention builds sdpa's masks: an eager model would get masks it cannot read
    (no causal mask at all), so it is left alone."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = T.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    cache = tq_cli.kv_cache(model, bits=3.5)
    assert not cache.code_attention and model.config._attn_implementation == "eager"
    with pytest.raises(UnsupportedError, match="'eager' \\(tq's stands in for sdpa only\\)"):
        tq_cli.kv_cache(model, bits=3.5, code_attention=True)


def test_a_cache_filled_outside_a_forward_attends_on_the_codes() -> None:
    """Updates with no attention after them (a cache filled directly, as `tq bench` does)
    only offer the probe again; the first decode step meets it and the next ones attend
    on the codes, with the decoding path's logits."""
    from transformers import DynamicCache

    from tq_cli.kvcache.cache import fill_from

    model = _model()
    ids = torch.randint(0, 200, (1, 80), generator=torch.Generator().manual_seed(5))
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full, use_cache=True)
    step = ids[:, -1:]
    ref, fed = _decode(model, fill_from(tq_cli.kv_cache(model, code_attention=False,
                                                        bits=3.5, window=8), full), step, 4)
    cache = fill_from(tq_cli.kv_cache(model, code_attention=True, bits=3.5, window=8), full)
    assert [layer.probe.state for layer in cache.layers] == ["offered", "offered"]
    got = _decode(model, cache, step, 4, fed=fed)[0]
    assert [layer.probe.state for layer in cache.layers] == ["seen", "seen"]
    _close(ref, got)


def test_a_probe_left_offered_is_not_refused_by_another_cache() -> None:
    """A cache filled directly leaves its last layer's probe offered; a forward through
    another cache, whose probes are settled, never refuses it."""
    from transformers import DynamicCache

    from tq_cli.kvcache.cache import fill_from

    model = _model()
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(6))
    full = DynamicCache(config=model.config)
    settled = tq_cli.kv_cache(model, code_attention=True, bits=3.5, window=8)
    with torch.no_grad():
        model(ids, cache=full, use_cache=True)
        model(ids, cache=settled, use_cache=True)
        assert [layer.probe.state for layer in settled.layers] == ["seen", "seen"]
        filled = fill_from(tq_cli.kv_cache(model, code_attention=True, bits=3.5, window=8),
                           full)
        model(ids[:, -1:], cache=settled, use_cache=True)
    assert [layer.probe.state for layer in filled.layers] == ["offered", "offered"]

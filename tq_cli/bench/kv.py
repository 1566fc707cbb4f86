"""KV cache benchmark: bytes per token against bf16 at long contexts, and what the cache
costs per decoded token.

Memory: a TurboQuant cache is filled with `context` random key/value tokens shaped like
SmolLM2-135M's attention (30 layers, 3 KV heads, head_dim 64, the default 128-token
full-precision window) and its bytes are counted as stored: packed codes, fp16 norms,
the window at 16 bits, channel orders and the shared rotation matrices. Every layer
stores the same, so one layer is filled and multiplied; the rotations are counted once.
Deterministic, so its ratios are gated like quality.

Decode: a randomly initialised SmolLM2-shaped model (fewer layers in a quick run) gets
`context` random tokens in every layer of transformers' DynamicCache and, coded, of each
TurboQuant cache; the same decode steps run through each, alternately, and the
per-token medians are compared, with the bytes of cache each step reads against the
machine's measured copy bandwidth. TurboQuant caches attend on the codes
(`kvcache.attend`); one 3.5-bit cache decodes its codes first, the reference path.
Where the kv-compare extra is installed, transformers' 4-bit QuantizedCache (quanto,
HQQ) is timed beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tq_cli.bench.metrics import Metric, cpu_copy_bandwidth_gb_s, memory_bandwidth_gb_s

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, HEADS, FFN = 30, 3, 64, 576, 9, 1536
WINDOW = 128
BITS = (4.0, 3.5, 3.0, 2.5)
MEMORY_BITS = (*BITS, 2.0)  # bytes are cheap to count; decode is timed at BITS only
CONTEXTS = (2048, 4096, 8192, 32768)
QUICK_CONTEXTS = (2048, 8192)
DECODE = {"quick": (2, (512,), 8), "full": (LAYERS, CONTEXTS, 16)}  # layers, ctx, steps


# Families the decode table can be built in (SmolLM2's shapes either way): Llama, and
# Phi-3 (fused q/k/v and gate/up projections, its own attention module).
FAMILIES = ("llama", "phi3")


def _config(layers: int, context: int, family: str = "llama") -> Any:
    import transformers

    cls = {"llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config}[family]
    return cls(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=FFN,
               num_hidden_layers=layers, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
               max_position_embeddings=max(context + 64, 2048), tie_word_embeddings=True,
               pad_token_id=0, bos_token_id=None, eos_token_id=None)


def _model(config: Any) -> Any:
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM,
           "phi3": transformers.Phi3ForCausalLM}[config.model_type]
    return cls(config)


def memory_row(context: int, bits: float, device: torch.device) -> dict[str, Any]:
    from tq_cli.kvcache.cache import kv_cache
    from tq_cli.kvcache.layers import TurboQuantLayer

    cache = kv_cache(_config(1, context), bits=bits, window=WINDOW)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert isinstance(layer, TurboQuantLayer)
    mem = layer.memory()
    per_layer = mem["code_bytes"] + mem["full_elements"] * 2 + mem["side_bytes"]
    total = LAYERS * per_layer + cache.bank.material_bytes()
    bf16 = LAYERS * 2 * mem["elements"]
    spec = cache.spec
    return {"table": "memory", "context": context, "bits": bits,
            "key_bits": spec.key_bits, "value_bits": spec.value_bits,
            "bytes_per_token": total / context, "bf16_bytes_per_token": bf16 / context,
            "vs_bf16": bf16 / total, "bits_per_element": 16 * total / bf16}


def _filled(model: Any, context: int, device: torch.device) -> Any:
    """A full-precision cache holding `context` random tokens in every layer (no prefill
    forward: what a decode step costs does not depend on the values, and a 32k-token
    prefill would take minutes here)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    shape = (1, KV_HEADS, context, HEAD_DIM)
    for i in range(model.config.num_hidden_layers):
        k = torch.randn(*shape, generator=gen).to(device, model.dtype)
        v = torch.randn(*shape, generator=gen).to(device, model.dtype)
        cache.update(k, v, i)
    return cache


def _installed_backends() -> list[str]:
    """transformers' QuantizedCache backends installed here (the kv-compare extra)."""
    from tq_cli.errors import UnsupportedError
    from tq_cli.evaluation.kv_baselines import BACKENDS, check_backend

    found = []
    for backend in BACKENDS:
        try:
            check_backend(backend)
        except UnsupportedError:
            continue
        found.append(backend)
    return found


def _hf_filled(model: Any, backend: str, ref: Any) -> Any:
    """transformers' QuantizedCache (4 bits, groups of 64, a residual of WINDOW tokens
    like tq's window) holding the tokens of `ref`."""
    from tq_cli.evaluation.kv_baselines import hf_quantized_cache

    cache = hf_quantized_cache(model, backend, 4, WINDOW)
    for i, layer in enumerate(ref.layers):
        cache.update(layer.keys, layer.values, i)
    return cache


def _bytes_per_step(cache: Any, context: int, layers: int, element_bytes: int) -> float:
    """Bytes of cached keys and values a decode step reads: all of them."""
    from tq_cli.kvcache.cache import TurboQuantCache

    if isinstance(cache, TurboQuantCache):
        m = cache.memory()
        return float(m["code_bytes"] + m["full_bytes"])
    if hasattr(cache.layers[0], "nbits"):  # QuantizedCache: codes, scales and residual
        from tq_cli.evaluation.kv_baselines import hf_cache_bits

        return 2 * layers * KV_HEADS * context * HEAD_DIM * hf_cache_bits(cache) / 8
    return float(2 * layers * KV_HEADS * context * HEAD_DIM * element_bytes)


@torch.no_grad()
def _decode_times(model: Any, context: int, steps: int, device: torch.device,
                  ) -> tuple[list[str], list[float], list[float]]:
    """(labels, median µs per decode step, bytes each reads) with `context` tokens cached:
    transformers' DynamicCache first, then TurboQuant at each of BITS attending on the
    codes, then the 3.5-bit cache decoding its codes first (the reference path). Caches
    take one step each per round, alternately, so load from elsewhere hits them alike;
    all hold the same tokens at every round."""
    import copy

    from tq_cli.kvcache.cache import fill_from, kv_cache

    ids = torch.randint(0, model.config.vocab_size, (1, steps), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    ref = _filled(model, context, device)
    labels = ["DynamicCache", *(f"turboquant {b:g}-bit" for b in BITS),
              "turboquant 3.5-bit, decoding first"]
    caches: list[Any] = [copy.deepcopy(ref)]
    caches += [fill_from(kv_cache(model, bits=b, window=WINDOW), ref) for b in BITS]
    caches.append(fill_from(kv_cache(model, bits=3.5, window=WINDOW, code_attention=False),
                            ref))
    for backend in _installed_backends():
        labels.append(f"QuantizedCache {backend} 4-bit")
        caches.append(_hf_filled(model, backend, ref))
    nbytes = [_bytes_per_step(c, context, model.config.num_hidden_layers,
                              model.dtype.itemsize) for c in caches]
    times: list[list[float]] = [[] for _ in caches]
    for t in range(steps):
        for i, cache in enumerate(caches):
            t0 = time.perf_counter()
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i].append((time.perf_counter() - t0) * 1e6)
    return labels, [statistics.median(x) for x in times], nbytes


def decode_rows(device: torch.device, quick: bool,
                progress: Callable[[str], None] | None = None, family: str = "llama",
                contexts: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    layers, all_contexts, steps = DECODE["quick" if quick else "full"]
    contexts = contexts or all_contexts
    # what a large copy moves here (CPU), or the device's theoretical peak (CUDA)
    bandwidth = ((memory_bandwidth_gb_s(device) or 0.0) if device.type == "cuda"
                 else cpu_copy_bandwidth_gb_s())
    rows = []
    for context in contexts:
        if progress:
            progress(f"kv decode: {context} tokens, {layers} layers, {steps} steps")
        torch.manual_seed(0)
        model: Any = _model(_config(layers, context, family))
        model = model.to(device).eval()
        labels, med, nbytes = _decode_times(model, context, steps, device)
        for label, us, nb in zip(labels, med, nbytes, strict=True):
            rows.append({"table": "decode", "family": family, "context": context,
                         "layers": layers,
                         "cache": label, "ms_per_token": us / 1e3,
                         "vs_dynamic": us / med[0], "overhead": us / med[0] - 1,
                         "cache_bytes_per_step": nb,
                         "cache_gb_s": nb / (us / 1e6) / 1e9,
                         "copy_gb_s": bandwidth})
    return rows


def run(device: torch.device, quick: bool, progress: Callable[[str], None] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Metric]]:
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Metric] = {}
    for context in QUICK_CONTEXTS if quick else CONTEXTS:
        for bits in MEMORY_BITS:
            if progress:
                progress(f"kv memory: {bits:g} bits at {context} tokens")
            r = memory_row(context, bits, device)
            rows.append(r)
            metrics[f"kv.memory.{context}.{bits:g}bit.vs_bf16"] = Metric(
                r["vs_bf16"], "quality", "higher", "x")
    for r in decode_rows(device, quick, progress):
        rows.append(r)
        if r["cache"] != "DynamicCache":
            tag = r["cache"].removeprefix("turboquant ").replace(", decoding first", ".decoding") \
                .replace("QuantizedCache ", "hf.").replace(" ", ".")
            name = f"kv.decode.{r['context']}.{tag}.vs_dynamic"
            # Ratios from the same run; reported, not gated: a few steps on a shared CPU
            # move too much for a gate.
            metrics[name] = Metric(r["vs_dynamic"], "info", "lower", "x")
    return rows, metrics

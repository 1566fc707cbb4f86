"""What a quantized KV cache costs a causal LM: perplexity, KL, top-1 and passkey retrieval
with the scored tokens attending to a cached, quantized past.

Protocol (per window of `context` tokens): the first `prefill` tokens go through the
cache in one forward (unscored); the rest are fed in chunks of `chunk` tokens, each one
forward that reads the cache, and every chunk's next-token predictions are scored. A
chunk's queries read the tokens older than the cache's full-precision window from codes,
as decoding does. (One forward over the whole window would never read a quantized key.)
The reference is the same model through a full-precision cache, fed the same way, so the
differences are the cache's alone. A prefill reads its own tokens at full precision
whatever the cache, so it runs once per window and is copied into every cache
(`cache.fill_from`). Memory is measured at the end of each window: the context used.
What to measure is a KVEvalSpec (tq_cli.evaluation.spec): `evaluate_kv` runs it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from tq_cli.errors import TqError, UnsupportedError
from tq_cli.evaluation.kv_baselines import (
    check_backend,
    hf_cache_bits,
    hf_quantized_cache,
    supported_bits,
)
from tq_cli.evaluation.needle import cases, run_needle
from tq_cli.evaluation.spec import KVEvalSpec, NeedleSpec, kv_item_spec, whole_bits
from tq_cli.io.text import Text
from tq_cli.kvcache.cache import TurboQuantCache, enable_code_attention, fill_from
from tq_cli.kvcache.spec import KVSpec

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class KVSetting:
    """One cache to measure: a TurboQuant spec, or transformers' QuantizedCache."""

    label: str
    spec: KVSpec | None = None
    backend: str | None = None  # "quanto" | "hqq" for transformers' QuantizedCache
    bits: int = 4  # with backend
    residual: int = 128  # with backend
    codes: bool = True  # attend on the codes where the model supports it

    def make(self, model: nn.Module) -> Any:
        if self.spec is not None:
            code = self.codes and enable_code_attention(model)
            return TurboQuantCache(self.spec, model.config, measure_error=True,
                                   code_attention=code)
        assert self.backend is not None
        return hf_quantized_cache(model, self.backend, self.bits, self.residual)


@dataclass
class _Acc:
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    scored: int = 0
    seconds: float = 0.0
    bits: list[float] = field(default_factory=list)
    errors: dict[str, list[float]] = field(default_factory=lambda: {"key": [], "value": []})


def _cache_bits(cache: Any) -> tuple[float, dict[str, float] | None]:
    if isinstance(cache, TurboQuantCache):
        return cache.memory(full_element_bytes=2)["bits_per_element"], cache.errors()
    if isinstance(cache, DynamicCache):
        return 16.0, None
    return hf_cache_bits(cache), None


@torch.no_grad()
def kv_metrics(model: Any, ids: torch.Tensor, settings: list[KVSetting],
               spec: KVEvalSpec, progress: Progress | None = None) -> dict[str, Any]:
    """The reference (full-precision cache) and one row per setting, on the same tokens."""
    # KVEvalSpec guarantees 1 <= prefill < context - 1 and chunk >= 1.
    prefill = spec.prefill if spec.prefill is not None else spec.context // 2
    starts = list(range(0, ids.numel() - prefill - 1, spec.context))
    if not starts:
        raise TqError(f"the text has {ids.numel()} tokens, fewer than the prefill ({prefill})"
                      " plus 2; pass a longer --text or a smaller --context")
    dev = next(model.parameters()).device
    ref = _Acc()
    accs = [_Acc() for _ in settings]
    steps = sum(-(-(min(s + spec.context, ids.numel()) - 1 - s - prefill) // spec.chunk)
                for s in starts)
    done = 0
    for s in starts:
        window = ids[s:min(s + spec.context, ids.numel())].to(dev)
        ref_cache = DynamicCache(config=model.config)
        model(window[None, :prefill], cache=ref_cache, use_cache=True)
        caches = [fill_from(st.make(model), ref_cache) for st in settings]
        for c0 in range(prefill, window.numel() - 1, spec.chunk):
            c1 = min(c0 + spec.chunk, window.numel() - 1)
            inp, target = window[None, c0:c1], window[c0 + 1:c1 + 1]
            t0 = time.perf_counter()
            lr = model(inp, cache=ref_cache, use_cache=True).logits[0].float().log_softmax(-1)
            ref.seconds += time.perf_counter() - t0
            ref.nll -= float(lr.gather(-1, target[:, None]).sum())
            ref.scored += c1 - c0
            top = lr.argmax(-1)
            for acc, cache in zip(accs, caches, strict=True):
                t0 = time.perf_counter()
                lc = model(inp, cache=cache, use_cache=True).logits[0].float().log_softmax(-1)
                acc.seconds += time.perf_counter() - t0
                acc.nll -= float(lc.gather(-1, target[:, None]).sum())
                acc.kl += float((lr.exp() * (lr - lc)).sum())
                acc.agree += int((lc.argmax(-1) == top).sum())
                acc.scored += c1 - c0
            done += 1
            if progress:
                progress(done, steps)
        for acc, cache in zip(accs, caches, strict=True):
            bits, errs = _cache_bits(cache)
            acc.bits.append(bits)
            for k, v in (errs or {}).items():
                acc.errors[k].append(v)
    ref_ppl = math.exp(ref.nll / ref.scored)
    rows = []
    for st, acc in zip(settings, accs, strict=True):
        ppl = math.exp(acc.nll / acc.scored)
        row: dict[str, Any] = {
            "label": st.label, "kind": "turboquant" if st.spec else f"transformers-{st.backend}",
            "bits_per_element": sum(acc.bits) / len(acc.bits),
            "perplexity": ppl, "perplexity_change": ppl / ref_ppl - 1,
            "kl_mean": acc.kl / acc.scored, "top1_agreement": acc.agree / acc.scored,
            "scored_tokens": acc.scored, "forward_seconds": round(acc.seconds, 2),
        }
        if st.spec is not None:
            row["spec"] = st.spec.model_dump()
            row["key_rel_error"] = _mean(acc.errors["key"])
            row["value_rel_error"] = _mean(acc.errors["value"])
        rows.append(row)
    return {"reference_perplexity": ref_ppl, "reference_forward_seconds": round(ref.seconds, 2),
            "scored_tokens": ref.scored, "windows": len(starts), "prefill": prefill,
            "chunk": spec.chunk, "rows": rows}


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def needle_metrics(model: Any, tokenizer: Any, settings: list[KVSetting],
                   spec: NeedleSpec, progress: Progress | None = None,
                   ) -> dict[str, dict[str, Any]]:
    """Passkey retrieval with a full-precision cache ("full") and each setting's cache."""
    all_cases = cases(tokenizer, spec)
    total = len(all_cases) * (len(settings) + 1)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    makers = {st.label: _maker(st, model) for st in settings}
    return run_needle(model, tokenizer, makers, all_cases, tick)


def _maker(setting: KVSetting, model: nn.Module) -> Callable[[], Any]:
    return lambda: setting.make(model)


def settings_for(spec: KVEvalSpec) -> list[KVSetting]:
    """The caches a KVEvalSpec measures: one per --kv-bits item, then transformers'
    QuantizedCache for each `compare` backend at each whole width it supports."""
    out = []
    for raw in spec.bits:
        cache = kv_item_spec(raw, spec.split, spec.cache)
        out.append(KVSetting(f"{raw} ({cache.label})", cache,
                             codes=spec.attention == "codes"))
    for backend in spec.compare:
        check_backend(backend)
        for raw in spec.bits:
            b = whole_bits(raw)
            if b is not None and b in supported_bits(backend):
                out.append(KVSetting(f"transformers {backend} {b}-bit", backend=backend,
                                     bits=b, residual=spec.cache.window))
    return out


def evaluate_kv(candidate: str | Path, text: Text | None, spec: KVEvalSpec,
                progress: Progress | None = None) -> dict[str, Any]:
    """Load CANDIDATE (tq checkpoint or model folder), measure the cache of every
    --kv-bits item of `spec` against a full-precision cache on `text`, and the passkey
    test when `spec.needle` is set (`text` may be None when the spec has no items: the
    passkey prompts are generated)."""
    from transformers import AutoTokenizer

    from tq_cli.device import resolve_device
    from tq_cli.evaluation.compare import load_model, tokenizer_folder
    from tq_cli.runtime.hf_models import is_causal

    if spec.bits and text is None:
        raise TqError("the --kv-bits caches are scored on a text; pass one")
    settings = settings_for(spec)  # before the model: a missing backend fails at once
    t0 = time.perf_counter()
    model, folder = load_model(candidate, resolve_device(spec.device))
    if not is_causal(model):
        raise UnsupportedError(f"{folder}: a KV cache needs a causal LM; this is "
                               f"{type(model).__name__}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(folder))
    result: dict[str, Any] = {
        "kind": "kv-cache", "candidate": str(folder),
        "settings": {"device": str(next(model.parameters()).device), "dtype": "float32",
                     "full_precision_counted_as_bits": 16},
        "metrics": None,
    }
    if settings and text is not None:
        ids = tokenizer(text.text, return_tensors="pt").input_ids[0]
        if spec.max_tokens:
            ids = ids[:spec.max_tokens]
        metrics = kv_metrics(model, ids, settings, spec, progress)
        result["settings"].update({
            "text_source": text.source, "text_sha256": text.sha256, "context": spec.context,
            "chunk": spec.chunk, "max_tokens": spec.max_tokens, "text_tokens": int(ids.numel()),
            "prefill": metrics["prefill"], "scored_tokens": metrics["scored_tokens"]})
        result["metrics"] = metrics
    if spec.needle is not None:
        result["needle"] = needle_metrics(model, tokenizer, settings, spec.needle, progress)
        result["settings"]["needle"] = spec.needle.model_dump()
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result

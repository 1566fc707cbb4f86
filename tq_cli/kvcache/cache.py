"""The TurboQuant KV cache for transformers models, and how a model gets it by default.

`kv_cache(model, bits=3.5)` builds a `TurboQuantCache`: a transformers `Cache` with one
layer per decoder layer, chosen from the model's layer types:

- full attention: `TurboQuantLayer` (codes outside the sinks and the recent window);
- sliding or chunked attention (Gemma 2/3, Mistral-style): transformers' own
  `DynamicSlidingWindowLayer` in full precision by default, since its cache is bounded by
  the sliding window (at 32k context it is a few percent of a Gemma 3 cache), or
  `TurboQuantSlidingLayer` with `sliding="quantize"`;
- layers listed in `full_precision_layers`, and layer kinds without a KV cache (linear
  attention, dummy): transformers' default layer for their type.

Use it as `model.generate(..., past_key_values=kv_cache(model))` (or `cache=`), or make it
the default of `generate()` with `use_kv_cache(model, spec)` (what `tq_cli.load(path,
kv_bits=...)` does).
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any

from pydantic import TypeAdapter, ValidationError
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from tq_cli.errors import UnsupportedError, first_error
from tq_cli.kvcache.attend import COMPILED_SDPA, NAME, register
from tq_cli.kvcache.layers import CodecBank, TurboQuantLayer, TurboQuantSlidingLayer
from tq_cli.kvcache.rope import RotaryAngles, inv_freq_for
from tq_cli.kvcache.spec import KVSpec, SplitPolicy, resolve_bits

SLIDING_TYPES = ("sliding_attention", "chunked_attention")


class TurboQuantCache(Cache):
    """A KV cache storing keys and values as TurboQuant codes (see `kvcache.layers`)."""

    def __init__(self, spec: KVSpec, config: Any, measure_error: bool = False,
                 code_attention: bool = False) -> None:
        text = config.get_text_config(decoder=True)
        types_, kwargs = get_layer_types_and_kwargs(text)
        n = len(types_)
        full = {i % n for i in spec.full_precision_layers if -n <= i < n}
        bad = [i for i in spec.full_precision_layers if not -n <= i < n]
        if bad:
            raise UnsupportedError(f"full_precision_layers: layer {bad[0]} does not exist; "
                                   f"the model has {n} layers (0..{n - 1}, or -1..-{n})")
        self.spec = spec
        self.bank = CodecBank(spec)
        ropes: dict[str, RotaryAngles | None] = {}

        def rope(kind: str) -> RotaryAngles | None:
            if not spec.center_keys or spec.key_bits is None:
                return None
            if kind not in ropes:
                inv = inv_freq_for(text, kind, _head_dim(text))
                ropes[kind] = None if inv is None else RotaryAngles(inv)
            return ropes[kind]

        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(types_, kwargs, strict=True)):
            if i in full:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            elif kind == "full_attention":
                layers.append(TurboQuantLayer(spec, self.bank, measure_error, rope(kind),
                                              code_attention, index=i))
            elif kind in SLIDING_TYPES and spec.sliding == "quantize":
                layers.append(TurboQuantSlidingLayer(spec, self.bank, kw["sliding_window"],
                                                     measure_error, rope(kind)))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        self.code_attention = code_attention

    def memory(self, full_element_bytes: int | None = None) -> dict[str, Any]:
        """What the cache holds, in bytes, with effective bits per cached element.

        Codes include norms and sketches; `full` is every element held in full precision
        (sinks, windows, full-precision and sliding layers), counted at
        `full_element_bytes` each when given (2: as in a bf16/fp16 model) or at its actual
        size; `side` is the channel orders and the shared rotation and sketch matrices.
        `elements` counts the cached key and value elements, `bf16_bytes` what a bf16
        cache of them would hold.
        """
        code = side = full_el = full_b = elements = 0
        for layer in self.layers:
            if isinstance(layer, TurboQuantLayer):
                m = layer.memory()
                code += m["code_bytes"]
                side += m["side_bytes"]
                full_el += m["full_elements"]
                full_b += m["full_bytes"]
                elements += m["elements"]
            elif isinstance(layer, DynamicLayer) and layer.keys is not None and \
                    layer.values is not None:
                n = layer.keys.numel() + layer.values.numel()
                full_el += n
                full_b += n * layer.keys.element_size()
                elements += n
        side += self.bank.material_bytes()
        if full_element_bytes is not None:
            full_b = full_el * full_element_bytes
        total = code + full_b + side
        return {"code_bytes": code, "full_bytes": full_b, "side_bytes": side,
                "total_bytes": total, "elements": elements, "bf16_bytes": 2 * elements,
                "bits_per_element": 8 * total / elements if elements else 0.0,
                "vs_bf16": 2 * elements / total if total else 0.0}

    def errors(self) -> dict[str, float]:
        """Relative squared reconstruction error of the coded keys and values, summed over
        layers (needs measure_error=True); NaN for a stream never coded."""
        out = {}
        for i, name in enumerate(("key", "value")):
            err = energy = 0.0
            for layer in self.layers:
                if isinstance(layer, TurboQuantLayer) and layer.streams is not None:
                    err += layer.streams[i].err
                    energy += layer.streams[i].energy
            out[name] = err / energy if energy else float("nan")
        return out


def _head_dim(text: Any) -> int:
    d = getattr(text, "head_dim", None)
    return int(d) if d else int(text.hidden_size // text.num_attention_heads)


def fill_from(cache: Cache, prefilled: Cache) -> Cache:
    """Put into `cache` what a prefill forward through it would have stored, from a
    full-precision cache that ran that prefill: a prefill reads its own tokens at full
    precision whatever the cache, so only what is stored differs. Lets an evaluation run
    one prefill and compare many caches after it. Returns `cache`."""
    for i, (dst, src) in enumerate(zip(cache.layers, prefilled.layers, strict=True)):
        keys, values = getattr(src, "keys", None), getattr(src, "values", None)
        if keys is None or values is None or not getattr(src, "is_initialized", False):
            continue
        if type(dst) is type(src):
            cache.layers[i] = copy.deepcopy(src)
            continue
        # Quantizing layers (ours, transformers' QuantizedLayer) store what they are given.
        dst.update(keys, values)  # type: ignore[union-attr]
        if isinstance(src, DynamicSlidingWindowLayer):
            dst.cumulative_length = src.cumulative_length  # type: ignore[union-attr]
    return cache


def make_spec(bits: float | None = 3.5, window: int = 128, split: SplitPolicy = "kv",
              **options: Any) -> KVSpec:
    """A KVSpec from average bits (None: full precision) under a split policy; options are
    KVSpec fields (key_bits/value_bits override the split). Raises UnsupportedError."""
    try:
        # Validated first, as the CLI's flags are: "abc", True or a window of 2.5 are
        # refused by name.
        if isinstance(bits, bool):
            raise ValueError(f"bits: must be a number, got {bits!r}")
        bits = _checked("bits", float | None, bits, strict=False)
        window = _checked("window", int, window, strict=True)
        kb, vb = resolve_bits(bits, split) if bits is not None else (None, None)
        fields: dict[str, Any] = {"key_bits": kb, "value_bits": vb, "window": window}
        fields.update(options)
        return KVSpec(**fields)
    except ValidationError as e:
        where, what = first_error(e)
        raise UnsupportedError(f"KV cache settings: {where + ': ' if where else ''}{what}") \
            from e
    except ValueError as e:
        raise UnsupportedError(f"KV cache settings: {e}") from e


def _checked(name: str, kind: Any, value: Any, strict: bool) -> Any:
    try:
        return TypeAdapter(kind).validate_python(value, strict=strict)
    except ValidationError as e:
        raise ValueError(f"{name}: {first_error(e)[1]}") from None


def code_attention_because(model: Any) -> str | None:
    """Why `model` cannot attend on the codes (None: it can, any family that runs sdpa:
    each layer checks on its first forward that the keys reach tq's attention function as
    the cache returned them, `kvcache.attend.KeysProbe`, and decodes first where not)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return "given a config, not a model"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", NAME, COMPILED_SDPA):
        # tq's builds sdpa's masks: an eager model would get masks it does not read
        return f"it runs attention implementation '{impl}' (tq's stands in for sdpa only)"
    return None


def enable_code_attention(model: Any) -> bool:
    """Switch `model` to tq's attention (decode steps on the codes, everything else the
    model's own sdpa) where it can; False, with a log line, where not."""
    why = code_attention_because(model)
    if why is not None:
        logging.getLogger("tq").info("tq: KV cache decodes coded tokens before attention: %s",
                                     why)
        return False
    register()
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    return True


def kv_cache(model: Any, bits: float | None = 3.5, window: int = 128, *,
             split: SplitPolicy = "kv", spec: KVSpec | None = None,
             measure_error: bool = False, code_attention: bool | None = None,
             **options: Any) -> TurboQuantCache:
    """A fresh TurboQuant KV cache for `model` (or its config).

    bits: average bits per cached element of the coded tokens (3.5: keys 4, values 3 with
    split="kv"); window: recent tokens kept in full precision; options: other KVSpec
    fields (key_bits, value_bits, sinks, full_precision_layers, sliding, rotation,
    rescale, center, center_keys, qjl, seed). A `spec` replaces all of these.
    code_attention: decode steps attend on the codes (`kvcache.attend`), switching the
    model to tq's attention function; None (the default): where the model supports it,
    False: decode coded tokens before attention (the reference path).
    """
    from transformers import PretrainedConfig

    config = getattr(model, "config", model)
    if not isinstance(config, PretrainedConfig):
        raise UnsupportedError(f"KV cache settings: model: must be a transformers model or "
                               f"its config, got {type(model).__name__}")
    if model is not config and callable(getattr(model, "can_generate", None)) \
            and not model.can_generate():
        raise UnsupportedError(f"KV cache settings: model: {type(model).__name__} does not "
                               "generate; the KV cache serves generate() of a decoder")
    # every argument checked before the model is touched (code attention switches its
    # attention function)
    spec = spec if spec is not None else make_spec(bits, window, split, **options)
    if not isinstance(spec, KVSpec):
        raise UnsupportedError(f"KV cache settings: spec: must be a KVSpec, got "
                               f"{type(spec).__name__}")
    if code_attention is not None and not isinstance(code_attention, bool):
        raise UnsupportedError(f"KV cache settings: code_attention: must be True, False or "
                               f"None, got {code_attention!r}")
    if not isinstance(measure_error, bool):
        raise UnsupportedError(f"KV cache settings: measure_error: must be True or False, "
                               f"got {measure_error!r}")
    code = False
    if code_attention is not False:
        code = enable_code_attention(model)
        if code_attention and not code:
            raise UnsupportedError(f"code_attention: {code_attention_because(model)}")
    return TurboQuantCache(spec, config, measure_error, code)


def use_kv_cache(model: Any, spec: KVSpec) -> Any:
    """Make `model.generate()` use a fresh TurboQuant cache unless given a cache or a
    cache_implementation. Returns the model; `model.tq_kv_spec` records the spec."""
    original = model._prepare_cache_for_generation
    code = enable_code_attention(model)

    def prepare(self: Any, generation_config: Any, model_kwargs: dict, *args: Any,
                **kwargs: Any) -> Any:
        own = (model_kwargs.get("cache") is None and model_kwargs.get("past_key_values") is None
               and generation_config.use_cache is not False
               and generation_config.cache_implementation is None)
        if own:
            model_kwargs["cache"] = TurboQuantCache(spec, self.config,
                                                    code_attention=code)
        result = original(generation_config, model_kwargs, *args, **kwargs)
        if own:
            # Ours, not the caller's: generate() may drop it at the end like its own.
            model_kwargs["cache"]._is_user_defined = False
        return result

    model._prepare_cache_for_generation = types.MethodType(prepare, model)
    model.tq_kv_spec = spec
    return model

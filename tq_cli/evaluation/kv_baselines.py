"""transformers' own quantized KV cache (KIVI-style, quanto or HQQ backend), the baseline
a TurboQuant cache is compared with at equal bits.

`QuantizedCache` quantizes integers per group of `q_group_size` with a scale and a zero
point per group, keeps up to `residual_length` recent tokens in full precision, and, each
time that residual fills, re-quantizes the whole cache (dequantized past included). Its
bits per element are computed here from its state: codes plus two 16-bit numbers per
group for quantized tokens, 16 bits for the residual (as in a bf16 model).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tq_cli.errors import UnsupportedError

# module, package, the widths compared: quanto takes 2 and 4; HQQ's 3-bit groups along
# axis 1 fail inside hqq 0.2.8's dequantize on SmolLM2's cache, so HQQ is 2 and 4 as well.
BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto", (2, 4)),
            "hqq": ("hqq", "hqq", (2, 4))}
GROUP = 64
# The quantization axis transformers' cache documentation recommends for each backend
# (HQQ's own default for 4-bit groups of 64 is axis 1 as well); axis 0 makes HQQ ~10x worse.
AXIS = {"quanto": 0, "hqq": 1}


def supported_bits(backend: str) -> tuple[int, ...]:
    return BACKENDS[backend][2]


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UnsupportedError(f"--kv-compare: unknown backend {backend!r}; use quanto or hqq")
    module, package, _ = BACKENDS[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UnsupportedError(f"--kv-compare {backend}: the {package} package is not "
                               f"installed; pip install {package}")


def hf_quantized_cache(model: Any, backend: str, bits: int, residual_length: int) -> Any:
    """transformers' QuantizedCache for `model`: groups of 64, the recommended axis."""
    from transformers.cache_utils import QuantizedCache

    check_backend(backend)
    if bits not in supported_bits(backend):
        raise UnsupportedError(f"--kv-compare {backend}: {bits} bits is not supported "
                               f"(only {', '.join(map(str, supported_bits(backend)))})")
    config = getattr(model, "config", model)
    return QuantizedCache(backend=backend, config=config, nbits=bits, q_group_size=GROUP,
                          residual_length=residual_length, axis_key=AXIS[backend],
                          axis_value=AXIS[backend])


def hf_cache_bits(cache: Any) -> float:
    """Bits per cached element of a QuantizedCache, from how many tokens are quantized
    and how many wait in its full-precision residual."""
    bits = tokens = 0.0
    for layer in cache.layers:
        total = layer.cumulative_length
        residual = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
        bits += (total - residual) * (layer.nbits + 32 / layer.q_group_size) + residual * 16
        tokens += total
    return bits / tokens if tokens else 0.0

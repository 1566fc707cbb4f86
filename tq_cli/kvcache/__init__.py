"""TurboQuant KV cache: keys and values stored as a few bits per coordinate.

Zandieh et al. 2025 (arXiv:2504.19874): per vector, an fp16 norm and the Lloyd-Max codes
of the randomly rotated unit vector. Modules: `codebook` (the exact codebooks), `spec`
(KVSpec), `quantizer` (the vector quantizers), `store` (append-only token storage),
`layers` and `cache` (the transformers Cache), `evaluate` and `needle` (measurements),
`baselines` (transformers' QuantizedCache, for comparison).

    cache = tq_cli.kv_cache(model, bits=3.5, window=128)
    model.generate(**inputs, cache=cache)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "KVSpec": "tq_cli.kvcache.spec",
    "TurboQuantCache": "tq_cli.kvcache.cache",
    "kv_cache": "tq_cli.kvcache.cache",
    "make_spec": "tq_cli.kvcache.cache",
    "use_kv_cache": "tq_cli.kvcache.cache",
}

if TYPE_CHECKING:
    from tq_cli.kvcache.cache import TurboQuantCache, kv_cache, make_spec, use_kv_cache
    from tq_cli.kvcache.spec import KVSpec


def __getattr__(name: str) -> Any:
    # Lazy: the codebook and quantizer need no transformers; the cache classes do.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tq_cli.kvcache' has no attribute {name!r}")


__all__ = ["KVSpec", "TurboQuantCache", "kv_cache", "make_spec", "use_kv_cache"]

"""TurboQuant KV cache: keys and values stored as a few bits per coordinate.

Zandieh et al. 2025 (arXiv:2504.19874): per vector, an fp16 norm and the Lloyd-Max codes
of the randomly rotated unit vector. Modules: `codebook` (the exact codebooks), `spec`
(KVSpec), `codec` (the vector quantizers), `rope` (keys centered before RoPE), `store`
(append-only token storage), `layers` and `cache` (the transformers Cache). Its
measurements live in `tq_cli.evaluation` (`kv`, `needle`, `kv_baselines`).

    cache = tq_cli.kv_cache(model, bits=3.5, window=128)
    model.generate(**inputs, past_key_values=cache)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_cli._lazy import lazy_face

if TYPE_CHECKING:
    from tq_cli.kvcache.cache import TurboQuantCache, kv_cache, make_spec, use_kv_cache
    from tq_cli.kvcache.spec import KVSpec

# Lazy: the codebook and codec need no transformers; the cache classes do.
__getattr__ = lazy_face(__name__, {
    "KVSpec": "spec",
    "TurboQuantCache": "cache",
    "kv_cache": "cache",
    "make_spec": "cache",
    "use_kv_cache": "cache",
})
__all__ = ["KVSpec", "TurboQuantCache", "kv_cache", "make_spec", "use_kv_cache"]

"""`tq eval`: what quantization costs, side by side with the original.

`compare` (perplexity, KL, top-1 / embedding cosine against a reference), `sweep`
(convert and evaluate a grid), `kv` and `needle` (the KV cache: perplexity through the
cache, passkey retrieval), `kv_baselines` (transformers' quantized caches).
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "evaluate": "compare",
    "EvalSpec": "compare",
})
__all__ = ["EvalSpec", "evaluate"]

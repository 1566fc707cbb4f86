"""`tq eval`: what quantization costs, side by side with the original.

Three modes, each with a validated spec in `spec`: `compare` (perplexity, KL, top-1 /
embedding cosine against a reference; CompareSpec), `sweep` (convert and evaluate a
grid; SweepSpec), `kv` and `needle` (the KV cache: perplexity through the cache,
passkey retrieval; KVEvalSpec), with `kv_baselines` (transformers' quantized caches).
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "evaluate": "compare",
    "run_compare": "compare",
    "evaluate_kv": "kv",
    "evaluate_sweep": "sweep",
    "EvalSpec": "spec",
    "CompareSpec": "spec",
    "KVEvalSpec": "spec",
    "SweepSpec": "spec",
})
__all__ = ["CompareSpec", "EvalSpec", "KVEvalSpec", "SweepSpec", "evaluate", "evaluate_kv",
           "evaluate_sweep", "run_compare"]

"""`tq bench`: quality per bit, kernel timings and conversion throughput, gated.

`run` measures the sections (`quality`, `kernels`, `conversion`, `kv`) into a
BenchResult; `metrics` compares one against a baseline; `synthetic_llama` writes the
synthetic model the conversion section converts.
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "BenchSpec": "run",
    "BenchResult": "run",
    "run_bench": "run",
    "SECTIONS": "run",
    "OPTIONAL_SECTIONS": "run",
})
__all__ = ["OPTIONAL_SECTIONS", "SECTIONS", "BenchResult", "BenchSpec", "run_bench"]

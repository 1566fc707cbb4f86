"""`tq bench`'s run: every section measured, the result gated against a baseline.

`run_bench` measures (one module per section); `metrics.compare` gates a result against
a baseline. Sections: quality (deterministic, tight gate), kernels and conversion (ratios
within the run, loose gate, same device kind only).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import tq_cli.bench.conversion as conversion
import tq_cli.bench.kernels as kernels
import tq_cli.bench.kv as kv
import tq_cli.bench.moe as moe
import tq_cli.bench.quality as quality
from tq_cli.bench.metrics import Comparison, Metric, compare, environment

SECTIONS = ("quality", "kernels", "conversion")
# Run only when asked for (--section kv: it times a 30-layer model at 8k context; --section
# moe: it builds a 64-expert layer).
OPTIONAL_SECTIONS = ("kv", "moe")
RESULT_VERSION = 1


@dataclass(frozen=True)
class BenchSpec:
    quick: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sections: tuple[str, ...] = SECTIONS
    bits: int = 4
    scratch: Path | None = None  # where the synthetic model is written (default: temp)


@dataclass
class BenchResult:
    spec: BenchSpec
    sections: dict[str, list[dict[str, Any]]]
    metrics: dict[str, Metric]
    env: dict[str, Any]
    seconds: float
    comparison: Comparison | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RESULT_VERSION, "mode": "quick" if self.spec.quick else "full",
            "seconds": round(self.seconds, 2), "environment": self.env,
            "sections": self.sections,
            "metrics": {k: {"value": m.value, "kind": m.kind, "better": m.better,
                            "unit": m.unit} for k, m in sorted(self.metrics.items())},
            "comparison": self.comparison.to_dict() if self.comparison else None,
        }

    def gate(self, baseline: dict[str, Any], max_regression: float,
             max_slowdown: float) -> Comparison:
        self.comparison = compare(self.metrics, self.spec.device.type, baseline,
                                  max_regression, max_slowdown, self.env.get("cpu_gemm"),
                                  self.env.get("cpu_isa"))
        return self.comparison


def run_bench(spec: BenchSpec, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run the selected sections on `spec.device`."""
    t0 = time.perf_counter()
    sections: dict[str, list[dict[str, Any]]] = {}
    metrics: dict[str, Metric] = {}
    if "quality" in spec.sections:
        sections["quality"], m = quality.run(spec.device, progress)
        metrics.update(m)
    if "kernels" in spec.sections:
        sections["kernels"], m = kernels.run(spec.device, spec.quick, spec.bits, progress)
        metrics.update(m)
    if "conversion" in spec.sections:
        if spec.scratch is not None:
            spec.scratch.mkdir(parents=True, exist_ok=True)
            sections["conversion"], m = conversion.run(spec.device, spec.quick, spec.scratch,
                                                       spec.bits, progress)
        else:
            with tempfile.TemporaryDirectory(prefix="tq-bench-") as tmp:
                sections["conversion"], m = conversion.run(spec.device, spec.quick,
                                                           Path(tmp), spec.bits, progress)
        metrics.update(m)
    if "kv" in spec.sections:
        sections["kv"], m = kv.run(spec.device, spec.quick, progress)
        metrics.update(m)
    if "moe" in spec.sections:
        sections["moe"], m = moe.run(spec.device, spec.quick, spec.bits, progress)
        metrics.update(m)
    return BenchResult(spec, sections, metrics, environment(spec.device),
                       time.perf_counter() - t0)

"""Benchmark metrics, their comparison with a baseline, and the environment record.

Every gated number is a `Metric` with a direction. Quality metrics are deterministic
(fixed seeds), so they are gated tightly; speed and memory metrics are ratios measured
in the same run (tq against torch, convert against a plain copy) or peak memory, and
are gated loosely, and only against a baseline from the same kind of device.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tq_cli.errors import TqError, first_error
from tq_cli.version import __version__
from tq_kernels import cpu as cpu_kernel

Kind = Literal["quality", "speed", "memory", "info"]  # info: reported, never gated


class BaselineError(TqError):
    """A baseline file is missing, damaged or has nothing in common with this run."""


class _BaselineMetric(BaseModel):
    model_config = ConfigDict(extra="allow")
    value: float = Field(allow_inf_nan=False)
    kind: Kind


class _BaselineEnv(BaseModel):
    model_config = ConfigDict(extra="allow")
    device_type: str
    cpu_gemm: str | None = None  # the CPU kernel's GEMM products; None: not recorded
    cpu_isa: str | None = None  # the CPU kernels' instruction set; None: not recorded


class BaselineDoc(BaseModel):
    """What the gate reads of a `tq bench --json` result."""

    model_config = ConfigDict(extra="allow")
    metrics: dict[str, _BaselineMetric]
    environment: _BaselineEnv


@dataclass(frozen=True)
class Metric:
    value: float
    kind: Kind
    better: Literal["lower", "higher"] = "lower"
    unit: str = ""


@dataclass(frozen=True)
class Regression:
    name: str
    baseline: float
    value: float
    change: float  # fraction worse than the baseline (0.1 = 10% worse)
    limit: float

    def describe(self) -> str:
        return (f"{self.name}: {self.value:.6g} vs baseline {self.baseline:.6g} "
                f"({self.change:+.1%} worse, limit {self.limit:.1%})")


@dataclass(frozen=True)
class Comparison:
    compared: int
    skipped: list[str]  # why some baseline metrics were not compared
    regressions: list[Regression]

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "skipped": self.skipped,
                "regressions": [asdict(r) for r in self.regressions]}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def worse_by(metric: Metric, baseline: float) -> float:
    """How much worse `metric` is than `baseline`, as a fraction (negative = better)."""
    if baseline == 0:
        return 0.0 if metric.value == 0 else float("inf")
    if metric.better == "lower":
        return (metric.value - baseline) / abs(baseline)
    return (baseline - metric.value) / abs(baseline)


def check_baseline(baseline: Any, name: str = "baseline") -> BaselineDoc:
    """The baseline validated, or a BaselineError naming the file and its first bad field."""
    try:
        return BaselineDoc.model_validate(baseline)
    except ValidationError as e:
        where, what = first_error(e)
        raise BaselineError(f"{name}: invalid at '{where}': {what}; write one with "
                            "tq bench --json FILE") from None


def compare(current: dict[str, Metric], current_device: str, baseline: dict[str, Any],
            max_regression: float, max_slowdown: float,
            current_cpu_gemm: str | None = None,
            current_cpu_isa: str | None = None) -> Comparison:
    """Gate `current` against a baseline result (the JSON `tq bench --json` writes).

    Quality metrics use `max_regression`; speed and memory use `max_slowdown` and are
    only compared when the baseline ran on the same kind of device (cpu vs cuda), CPU
    speeds only when both ran the same instruction set of tq's CPU kernels (an AVX2
    machine's ratios are not an AVX-512 machine's), and kernel timings only when both ran
    the same CPU GEMM products (bf16 products are about twice as fast as float32 ones, so
    the two are different baselines).
    """
    doc = check_baseline(baseline)
    base_metrics = {k: m.model_dump() for k, m in doc.metrics.items()}
    base_device = doc.environment.device_type
    base_gemm = doc.environment.cpu_gemm
    base_isa = doc.environment.cpu_isa
    skipped: list[str] = []
    regressions: list[Regression] = []
    compared = 0
    for name, entry in sorted(base_metrics.items()):
        cur = current.get(name)
        if entry.get("kind") == "info" or (cur is not None and cur.kind == "info"):
            continue
        if cur is None:
            skipped.append(f"{name}: not measured in this run")
            continue
        if cur.kind != "quality" and base_device != current_device:
            skipped.append(f"{name}: baseline ran on {base_device}, this run on "
                           f"{current_device}")
            continue
        if (cur.kind == "speed" and current_device == "cpu" and base_isa and current_cpu_isa
                and base_isa != current_cpu_isa):
            skipped.append(f"{name}: baseline ran tq's {base_isa} CPU kernels, this run "
                           f"{current_cpu_isa}")
            continue
        if (cur.kind == "speed" and name.startswith("kernels.") and base_gemm
                and current_cpu_gemm and base_gemm != current_cpu_gemm):
            skipped.append(f"{name}: baseline ran {base_gemm} CPU GEMM products, this run "
                           f"{current_cpu_gemm}")
            continue
        limit = max_regression if cur.kind == "quality" else max_slowdown
        change = worse_by(cur, float(entry["value"]))
        compared += 1
        if change > limit:
            regressions.append(Regression(name, float(entry["value"]), cur.value, change, limit))
    if compared == 0:
        raise BaselineError("the baseline shares no metric with this run (was it made with "
                            "another tq version or --quick setting?); regenerate it with "
                            "tq bench --json FILE")
    return Comparison(compared, skipped, regressions)


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    env: dict[str, Any] = {
        "tq": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "device_type": device.type,
        "cuda": torch.version.cuda, "triton": None, "device_name": platform.processor() or "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # not installed or broken: recorded as None
        pass
    if device.type == "cpu" and cpu_kernel.available():
        env["cpu_gemm"] = cpu_kernel.gemm_precision()
        # a decode-sized 4-bit layer's one-row GEMV products (int8 where the CPU has VNNI)
        env["cpu_gemv_4bit"] = cpu_kernel.gemv_products(4, 128, 4096)
        env["cpu_isa"] = cpu_kernel.active_isa()  # what ran: the CPU's widest, or TQ_CPU_ISA
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["memory_bandwidth_gb_s"] = memory_bandwidth_gb_s(device)
    return env


def memory_bandwidth_gb_s(device: torch.device) -> float | None:
    """Theoretical DRAM bandwidth from the device properties, when torch exposes them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def cpu_copy_bandwidth_gb_s(mib: int = 256, reps: int = 5) -> float:
    """Bytes read + written per second by the fastest of `reps` large tensor copies."""
    import time

    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9

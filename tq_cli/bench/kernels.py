"""Kernel timings: tq's grouped matmul and rotation against torch.nn.functional.linear.

Both run on the same device in the same run, and the gated number is their ratio, so a
slower or busier machine moves both. On CUDA each call is captured in a CUDA graph and
replayed (launch overhead out, as in a decode loop), and the achieved GB/s of weight
traffic is set against the device's memory bandwidth. On CPU what runs is the torch
reference path (dequantize, then matmul), and the table says so.

The codes, scales and codebook are random: the kernels' time does not depend on the
values, and quantizing a 14336x4096 matrix only to time it would cost a minute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tq_cli.bench.metrics import Metric, geomean, memory_bandwidth_gb_s
from tq_cli.rotation import make_rotation
from tq_cli.spec import RotationSpec
from tq_kernels import dispatch
from tq_kernels.packing import packed_row_bytes

# (out, in): SmolLM2-135M's projections, then Llama-3-8B's.
SMOLLM2 = [(576, 576), (1536, 576), (576, 1536)]
LLAMA3_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]
BATCHES = [1, 4, 16, 64, 256]
QUICK_BATCHES = [1, 16]
GROUP = 128


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fns: list[Callable[[], object]], device: torch.device, min_reps: int = 7,
            budget_s: float = 1.0) -> list[float]:
    """Median microseconds of each of `fns` after warm-up.

    On CPU the functions are timed in alternation (one call of each per round), so a
    burst of load from elsewhere hits all of them alike and their ratio holds. On CUDA
    each is captured in a CUDA graph and replayed.
    """
    if device.type == "cuda":
        return [_graph_time_us(fn, max(min_reps, 20)) for fn in fns]
    for fn in fns:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_reps or (time.perf_counter() - start < budget_s
                                       and len(times[0]) < 50):
        for fn, acc in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            acc.append((time.perf_counter() - t) * 1e6)
    return [statistics.median(t) for t in times]


def _graph_time_us(fn: Callable[[], object], reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _operands(out_f: int, in_f: int, bits: int, device: torch.device,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (out_f, packed_row_bytes(in_f, bits)), generator=gen,
                          dtype=torch.uint8)
    scales = (torch.rand(out_f, -(-in_f // GROUP), generator=gen) * 0.02 + 0.01).half()
    codebook = torch.sort(torch.randn(1 << bits, generator=gen)).values
    return codes.to(device), scales.to(device), codebook.to(device)


def run(device: torch.device, quick: bool, bits: int = 4,
        progress: Callable[[str], None] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Metric]]:
    shapes = SMOLLM2 if quick else SMOLLM2 + LLAMA3_8B
    batches = QUICK_BATCHES if quick else BATCHES
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    backend = dispatch.backend_for(device)
    backend_name = "triton" if backend == "triton" else "torch reference (dequantize+matmul)"
    bandwidth = memory_bandwidth_gb_s(device) if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Metric] = {}
    for out_f, in_f in shapes:
        codes, scales, codebook = _operands(out_f, in_f, bits, device, gen)
        weight = torch.randn(out_f, in_f, generator=gen).to(device, dtype)
        rot = make_rotation(RotationSpec(kind="hadamard"), in_f, GROUP)
        assert rot.signs is not None
        signs = rot.signs.to(device)
        weight_bytes = sum(t.numel() * t.element_size() for t in (codes, scales, codebook))
        for m in batches:
            if progress:
                progress(f"kernels {out_f}x{in_f} batch {m}")
            x = torch.randn(m, in_f, generator=gen).to(device, dtype)
            kw = {"bits": bits, "group_size": GROUP, "out_features": out_f,
                  "in_features": in_f}
            t_mm, t_rot, t_ref = time_us([
                lambda x=x, kw=kw, c=codes, s=scales, cb=codebook:  # type: ignore[misc]
                    dispatch.grouped_matmul(x, c, s, cb, **kw),
                lambda x=x, sg=signs: dispatch.rotate(x, sg, GROUP),  # type: ignore[misc]
                lambda x=x, w=weight: F.linear(x, w),  # type: ignore[misc]
            ], device)
            row: dict[str, Any] = {
                "shape": f"{out_f}x{in_f}", "out": out_f, "in": in_f, "batch": m,
                "bits": bits, "backend": backend_name,
                "tq_matmul_us": t_mm, "tq_rotate_us": t_rot, "torch_linear_us": t_ref,
                "torch_dtype": str(dtype).removeprefix("torch."),
                "matmul_over_torch": t_mm / t_ref, "with_rotation_over_torch":
                    (t_mm + t_rot) / t_ref,
                "tq_gb_s": weight_bytes / t_mm / 1e3,
                "torch_gb_s": weight.numel() * weight.element_size() / t_ref / 1e3,
            }
            if bandwidth:
                row["tq_bandwidth_fraction"] = row["tq_gb_s"] / bandwidth
            rows.append(row)
            key = f"kernels.{device.type}.{out_f}x{in_f}.b{m}.{bits}bit"
            metrics[f"{key}.matmul_over_torch"] = Metric(row["matmul_over_torch"], "info")
            metrics[f"{key}.with_rotation_over_torch"] = Metric(
                row["with_rotation_over_torch"], "info")
        _sync(device)
    # One gated number per section and shape set: single small timings are too noisy to
    # gate on a shared machine, their geometric mean is not.
    subsets = {"smollm2": [r for r in rows if (r["out"], r["in"]) in SMOLLM2
                           and r["batch"] in QUICK_BATCHES]}
    if not quick:
        subsets["all"] = rows
    for tag, subset in subsets.items():
        for col in ("matmul_over_torch", "with_rotation_over_torch"):
            metrics[f"kernels.{device.type}.{tag}.{bits}bit.geomean_{col}"] = Metric(
                geomean([r[col] for r in subset]), "speed")
    return rows, metrics

"""Kernel benchmark on CUDA: tq grouped_matmul (+ rotation) against cuBLAS fp16.

Usage: python scripts/gpu_bench.py [--json FILE] [--bits 4]

Shapes (out x in) 4096x4096, 4096x14336, 14336x4096 at batch 1, 4, 16, 64, 256; each
timed under a CUDA graph (median of replays), reporting microseconds, achieved GB/s of
weight traffic and the speedup over torch.nn.functional.linear in fp16, in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch

from tq_cli.quantizer import quantize
from tq_cli.spec import QuantSpec, RotationSpec
from tq_kernels import dispatch

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
BATCHES = [1, 4, 16, 64, 256]


def graph_time_us(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    rows = []
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f) * in_f ** -0.5
        q = quantize(w, QuantSpec(bits=args.bits), RotationSpec(kind="hadamard"))
        codes, scales, cb = (t.cuda() for t in (q.codes, q.scales, q.codebook))
        assert q.rotation.signs is not None
        signs = q.rotation.signs.cuda()
        w16 = w.half().cuda()
        packed_bytes = sum(t.numel() * t.element_size() for t in (codes, scales, cb))
        for m in BATCHES:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
            kw = {"bits": args.bits, "group_size": 128, "out_features": out_f,
                  "in_features": in_f}
            t_mm = graph_time_us(partial(dispatch.grouped_matmul, x, codes, scales, cb, **kw))
            t_rot = graph_time_us(partial(dispatch.rotate, x, signs, 128))
            t_fp16 = graph_time_us(partial(torch.nn.functional.linear, x, w16))
            rows.append({
                "shape": [out_f, in_f], "batch": m, "bits": args.bits,
                "tq_matmul_us": round(t_mm, 2), "tq_rotate_us": round(t_rot, 2),
                "fp16_linear_us": round(t_fp16, 2),
                "tq_gb_s": round(packed_bytes / t_mm / 1e3, 1),
                "fp16_gb_s": round(w16.numel() * 2 / t_fp16 / 1e3, 1),
                "speedup_matmul": round(t_fp16 / t_mm, 3),
                "speedup_with_rotation": round(t_fp16 / (t_mm + t_rot), 3),
            })
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

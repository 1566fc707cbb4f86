"""The CPU decode GEMV (one activation row) with float32 and with bf16 products, per width.

Usage: python scripts/bench_gemv_products.py [--threads 1] [--json FILE]

For SmolLM2's MLP shapes and Llama-3-8B's 4096x4096 and 14336x4096, at 4, 3 and 2 bits
(group 128, no rotation, no outliers: the matmul alone), times `tq_kernels.cpu.linear`
with gemm_min_batch=0 (the lookup-table GEMV) and gemm="fp32" or "bf16" (bf16 dot products
where the CPU has AVX512-BF16, csrc/bf16_gemv.h; elsewhere both are float32), alternating,
best of 9 loops. Reports microseconds, the ratio, and the packed bytes (codes and scales)
read per second with bf16 products. The weights stay in cache between calls for the small
shapes (a decode step reads them once per token, from L2/L3 on SmolLM2's 56 MB).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tq_cli.quant.prepare import quantize
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import cpu

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (14336, 4096)]


def best_us(f: Callable[[], object], reps: int) -> float:
    for _ in range(5):
        f()
    best = float("inf")
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu.set_gemm_precision("bf16")  # so gemv_products() names what the bf16 column ran
    rows = []
    for out, n in SHAPES:
        w = torch.randn(out, n, generator=torch.Generator().manual_seed(out + n))
        for bits in (4, 3, 2):
            q = quantize(w, QuantSpec(bits=bits, group_size=128, outliers=0.0),
                         RotationSpec(kind="none"))
            x = torch.randn(1, n)
            us = {}
            for products in ("fp32", "bf16"):
                kw = {"bits": bits, "group_size": 128, "out_features": out,
                      "gemm_min_batch": 0, "gemm": products}
                us[products] = best_us(
                    lambda x=x, q=q, kw=kw: cpu.linear(  # type: ignore[misc]
                        x, None, 0, q.codes, q.scales, q.codebook, None, None, None, **kw),
                    max(3, int(2e7 / (out * n))))
            nbytes = q.codes.numel() + q.scales.numel() * 2
            row = {"shape": f"{out}x{n}", "bits": bits, "fp32_us": round(us["fp32"], 1),
                   "bf16_us": round(us["bf16"], 1), "speedup": round(us["fp32"] / us["bf16"], 2),
                   "bf16_gb_s": round(nbytes / us["bf16"] / 1e3, 1),
                   "products": cpu.gemv_products(bits, 128, n)}
            rows.append(row)
            print(f"{row['shape']:>10} {bits}-bit: fp32 {row['fp32_us']:8.1f} us, "
                  f"{row['products']} {row['bf16_us']:8.1f} us (x{row['speedup']}), "
                  f"{row['bf16_gb_s']} GB/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "isa": cpu.active_isa(),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

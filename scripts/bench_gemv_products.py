"""The CPU decode GEMV (one activation row) with float32, bf16 and int8 products, per width.

Usage: python scripts/bench_gemv_products.py [--threads 1] [--isa avx2] [--json FILE]

For SmolLM2's MLP shapes and Llama-3-8B's 4096x4096 and 14336x4096, at 4, 3 and 2 bits
(group 128, no rotation, no outliers: the matmul alone), times `tq_kernels.cpu.linear`
with gemm_min_batch=0 (the lookup-table GEMV) and gemm="fp32" or "bf16" (bf16 dot products
where the CPU has AVX512-BF16, csrc/bf16_gemv.h; elsewhere both are float32), and for
each width also with int8 products where they run (csrc/int8_gemv.h: AVX512-VNNI, 2 and
3 bits with VBMI too, or the AVX2 variant; `set_gemv_products`), one after the
other, best of 9 loops. Reports microseconds, the ratios to float32, and the packed bytes
(codes and scales) read per second by the fastest. --isa names the variant (avx2 on an
AVX-512 machine runs what an AVX2 CPU runs). The weights stay in cache between calls for
the small shapes (a decode step reads them once per token, from L2/L3 on SmolLM2's 56 MB).
Then the 8-bit heads of SmolLM2 (49152x576, 28 MB) and the Qwen2.5-0.5B shape (151936x896,
136 MB: larger than a desktop L3, so it streams from memory), on the uniform codebook a
stored head has (levels k - 127.5: an affine grid), random codes and scales, float32 and
int8 products (int8 where `native_int8_gemv(8)`: AVX2, or AVX-512 with VNNI).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tq_cli.quant.prepare import quantize
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import cpu

SHAPES = [(1536, 576), (576, 1536), (4096, 4096), (14336, 4096)]
HEADS = [(49152, 576), (151936, 896)]


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


def time_layer(name: str, out: int, n: int, bits: int, codes: torch.Tensor,
               scales: torch.Tensor, codebook: torch.Tensor, int8: bool,
               isa: str | None) -> dict[str, Any]:
    """One layer's GEMV with each product; prints and returns its row."""
    x = torch.randn(1, n)
    us = {}
    runs = [("fp32", "fp32", "bf16"), ("bf16", "bf16", "bf16")] if bits <= 4 else [
        ("fp32", "bf16", "bf16")]  # 8 bits: "bf16" products are float32 ones there
    if int8:
        runs.append(("int8", "bf16", "int8"))
    for label, gemm, gemv in runs:
        kw = {"bits": bits, "group_size": 128, "out_features": out,
              "gemm_min_batch": 0, "gemm": gemm, "isa": isa}

        def call(kw: dict = kw) -> torch.Tensor:
            return cpu.linear(x, None, 0, codes, scales, codebook, None, None, None, **kw)

        cpu.set_gemv_products(gemv)
        us[label] = best_us(call, max(3, int(2e7 / (out * n))))
    cpu.set_gemv_products(None)
    nbytes = codes.numel() + scales.numel() * 2
    fastest = min(us.values())
    row = {"shape": name, "bits": bits,
           **{f"{k}_us": round(v, 1) for k, v in us.items()},
           **{f"{k}_speedup": round(us["fp32"] / v, 2) for k, v in us.items() if k != "fp32"},
           "fastest_gb_s": round(nbytes / fastest / 1e3, 1)}
    print(f"{name:>10} {bits}-bit: " + ", ".join(
        f"{k} {v:8.1f} us" + (f" (x{us['fp32'] / v:.2f})" if k != "fp32" else "")
        for k, v in us.items()) + f"; fastest {row['fastest_gb_s']} GB/s", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default=None, help="the kernel variant (default: the best)")
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
            int8 = args.isa == "avx2" or cpu.native_int8_gemv(bits)
            rows.append(time_layer(f"{out}x{n}", out, n, bits, q.codes, q.scales, q.codebook,
                                   int8, args.isa))
    for out, n in HEADS:
        g = torch.Generator().manual_seed(out + n)
        codes = torch.randint(0, 256, (out, n), dtype=torch.uint8, generator=g)
        scales = (0.01 * torch.rand(out, -(-n // 128), generator=g)).half()
        levels = torch.arange(256, dtype=torch.float32) - 127.5
        rows.append(time_layer(f"{out}x{n}", out, n, 8, codes, scales, levels,
                               cpu.native_int8_gemv(8, args.isa), args.isa))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads,
                                         "isa": args.isa or cpu.active_isa(),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

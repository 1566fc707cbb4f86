"""tq's CPU kernel in the GEMM regime with bf16 and float32 products, against F.linear.

Usage: python scripts/bench_cpu_bf16.py [--threads 1] [--rows 16,128,512] [--bits 4]

Per shape (SmolLM2-135M's MLP, Llama-3-8B's 4096x4096) and row count, the fastest of 7
calls of the TQLinear forward:
- "tq bf16": bf16 activations, bf16 products (dequantized blocks and rotated
  activations rounded to bf16, torch's bf16 GEMM), what a bf16 model runs;
- "tq f32/b": float32 activations, bf16 products (the default), what a float32 model
  runs;
- "tq f32/f": float32 activations, float32 products (`gemm="fp32"`, TQ_CPU_GEMM=fp32);
and of F.linear with the weight in float32 and in bfloat16. Ratios: tq bf16 over bf16
F.linear, each float32 variant over fp32 F.linear, and fp32 over bf16 F.linear (how much
faster the bf16 GEMM is here). Same process, same inputs, so the ratios hold on a noisy
machine; the absolute times do not travel. Without bf16 dot products (AVX512-BF16/AMX)
"bf16 products" are float32 ones.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import cpu, isas

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))


def best_ms(fn: Callable[[], object], n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def time_rows(w: torch.Tensor, bits: int, m: int, g: torch.Generator) -> list[float]:
    """[tq bf16, tq f32/b, tq f32/f, F.linear fp32, F.linear bf16] ms for m rows into w."""
    out, n = w.shape
    q = quantize(w, QuantSpec(bits=bits, group_size=128), RotationSpec(kind="none"))
    signs = make_rotation(RotationSpec(kind="hadamard"), n, 128).signs
    wb = w.bfloat16()
    ops = (signs, 128, q.codes, q.scales, q.codebook, q.outlier_idx, q.outlier_val, None)
    kw = {"bits": bits, "group_size": 128, "out_features": out}
    x = torch.randn(m, n, generator=g)
    xb = x.bfloat16()
    return [best_ms(lambda: cpu.linear(xb, *ops, **kw, gemm="bf16")),
            best_ms(lambda: cpu.linear(x, *ops, **kw, gemm="bf16")),
            best_ms(lambda: cpu.linear(x, *ops, **kw, gemm="fp32")),
            best_ms(lambda: F.linear(x, w)), best_ms(lambda: F.linear(xb, wb))]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="16,128,512")
    ap.add_argument("--bits", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"tq CPU kernels: {isas.describe()}")
    print(f"{'shape':>10} {'rows':>5} {'tq bf16':>8} {'tq f32/b':>8} {'tq f32/f':>8} "
          f"{'fp32 F.lin':>10} {'bf16 F.lin':>10} {'bf16/bf16':>9} {'f32b/fp32':>9} "
          f"{'f32f/fp32':>9} {'fp32/bf16':>9}  (ms; ratios of times)")
    g = torch.Generator().manual_seed(0)
    for out, n in SHAPES:
        w = torch.randn(out, n, generator=g)
        for m in (int(r) for r in a.rows.split(",")):
            t_b, t_fb, t_ff, t_f32, t_b16 = time_rows(w, a.bits, m, g)
            print(f"{out}x{n:<5} {m:>5} {t_b:8.2f} {t_fb:8.2f} {t_ff:8.2f} {t_f32:10.2f} "
                  f"{t_b16:10.2f} {t_b / t_b16:9.2f} {t_fb / t_f32:9.2f} {t_ff / t_f32:9.2f} "
                  f"{t_f32 / t_b16:9.2f}")


if __name__ == "__main__":
    main()

"""Where the CPU kernel should switch from its lookup-table GEMV to dequantize + GEMM.

Usage: python scripts/bench_cpu_threshold.py [--bits 2,3,4] [--batches 1,2,4,...]
                                             [--llama] [--json FILE]

For each shape, width and batch it times `tq_kernels.cpu.linear` both ways in
alternation (gemm_min_batch=0: always the GEMV; =1: always the GEMM path) and prints
the smallest batch from which the GEMM path is faster for good (the crossover).
`tq_kernels.cpu.GEMM_MIN_BATCH` is set from these crossovers; rerun this on a quiet
machine after changing either path.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

from tq_cli.bench.kernels import GROUP, LLAMA3_8B, SMOLLM2, _operands, time_us
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import RotationSpec
from tq_kernels import cpu, isas


def _shape(bits: int, out_f: int, in_f: int, batches: list[int], gen: torch.Generator,
           rows: list[dict[str, Any]]) -> None:
    dev = torch.device("cpu")
    ops = _operands(out_f, in_f, bits, dev, gen)
    signs = make_rotation(RotationSpec(kind="hadamard"), in_f, GROUP).signs
    crossover = None
    for m in batches:
        x = torch.randn(m, in_f, generator=gen)
        gemv, gemm = time_us([
            functools.partial(cpu.linear, x, signs, GROUP, ops["codes"], ops["scales"],
                              ops["codebook"], ops["outlier_idx"], ops["outlier_val"], None,
                              bits=bits, group_size=GROUP, out_features=out_f,
                              gemm_min_batch=gmb)
            for gmb in (0, 1)], dev)
        crossover = (crossover or m) if gemm < gemv else None
        rows.append({"bits": bits, "shape": f"{out_f}x{in_f}", "batch": m,
                     "gemv_us": round(gemv, 1), "gemm_us": round(gemm, 1)})
        print(f"{bits}-bit {out_f}x{in_f} batch {m:3d}: GEMV {gemv:9.1f} µs  "
              f"GEMM {gemm:9.1f} µs", flush=True)
    print(f"{bits}-bit {out_f}x{in_f}: GEMM faster from batch {crossover}", flush=True)
    rows.append({"bits": bits, "shape": f"{out_f}x{in_f}", "crossover": crossover})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--batches", default="1,2,4,6,8,12,16,24,32,48,64")
    ap.add_argument("--llama", action="store_true", help="add the Llama-3-8B shapes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    batches = [int(b) for b in args.batches.split(",")]
    for bits in (int(b) for b in args.bits.split(",")):
        for out_f, in_f in SMOLLM2 + (LLAMA3_8B if args.llama else []):
            _shape(bits, out_f, in_f, batches, gen, rows)
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(),
                                         "isa": cpu.kernel_isa(4, GROUP), **isas.describe(),
                                         "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

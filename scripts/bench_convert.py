"""Convert time against a plain safetensors load + save of the same bytes, in one run.

Usage: python scripts/bench_convert.py [SOURCE] [--bits 4] [--json FILE]

SOURCE defaults to the SmolLM2-135M folder built from its PyPI wheel. The copy (the
fastest of repeated passes, as in `tq bench`) is timed before and after the conversion
and averaged, so a machine that gets busier half-way does not skew the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tq_cli.bench.conversion import copy_seconds
from tq_cli.converter import ConvertSpec, convert
from tq_cli.spec import QuantSpec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.source:
        src = Path(args.source)
    else:
        from tq_cli.demo_model import smollm2_folder

        src = smollm2_folder()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        c1 = copy_seconds(src, scratch)
        t = time.perf_counter()
        r = convert(src, scratch / "out", ConvertSpec(quant=QuantSpec(bits=args.bits)))
        conv = time.perf_counter() - t
        c2 = copy_seconds(src, scratch)
    copy = (c1 + c2) / 2
    row = {"source": str(src), "bits": args.bits, "source_bytes": r.source_bytes,
           "convert_s": round(conv, 2), "load_save_s": round(copy, 2),
           "load_save_runs_s": [round(c1, 2), round(c2, 2)],
           "ratio_convert_over_load_save": round(conv / copy, 2),
           "bits_per_weight": round(r.bits_per_weight, 4),
           "mean_rel_error": r.mean_rel_error, "cpu_count": os.cpu_count()}
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

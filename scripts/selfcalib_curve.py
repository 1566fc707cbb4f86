"""Quality and time of self-calibration by random-token count: the curve the default is
chosen from.

Usage: python scripts/selfcalib_curve.py [smollm2|minilm] [--tokens 0,1024,2048,4096,8192]
           [--bits 4] [--max-tokens 4096] [--json FILE]

For each count, `tq convert SOURCE --bits B --synthetic-calib N` (0: `--fast`, the
weight-only fit) in this process, timed, then `tq eval` of the result against the
source on the default evaluation text (`--max-tokens` of it): KL, perplexity and top-1
agreement for the decoder, the embeddings' cosine for the encoder. One row per count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.quant.spec import QuantSpec

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2", choices=["smollm2", "minilm"])
    ap.add_argument("--tokens", default="0,1024,2048,4096,8192")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))  # the MiniLM folder is built by the tests' helper
    from realmodels import minilm_folder

    from tq_cli.demo_model import smollm2_folder

    src = smollm2_folder() if args.model == "smollm2" else minilm_folder()
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            spec = ConvertSpec(quant=QuantSpec(bits=args.bits), device="cpu",
                               fast=n == 0, synthetic_calib=n or None)
            t0 = time.perf_counter()
            res = convert(src, out, spec)
            seconds = time.perf_counter() - t0
            ev = json.loads(subprocess.run(
                [sys.executable, "-m", "tq_cli", "eval", str(out), "--reference", str(src),
                 "--max-tokens", str(args.max_tokens), "--device", "cpu", "--json"],
                check=True, capture_output=True, text=True).stdout)
        row = {"model": args.model, "bits": args.bits, "tokens": n, "convert_s": round(seconds, 1),
               "bits_per_weight": round(res.bits_per_weight, 4),
               "calibrated_tensors": res.calibrated_tensors,
               "quality": ev.get("metrics", ev)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak RSS of `tq convert` on synthetic Llama-3.2-1B-shaped models, and with 2x layers.

Usage: python scripts/peak_rss.py [--scratch DIR] [--layers 16 32] [--json FILE]

Generates each model once in the scratch folder (bf16, two shards), converts it under
/usr/bin/time -v, and reports peak RSS against the size of one shard. The claim to
check: peak memory follows the largest tensor, not the shard or the model.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tq_cli.bench.synthetic_llama import LLAMA_3_2_1B, write_synthetic_llama


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scratch", type=Path, default=Path.home() / ".cache/tq/scratch")
    ap.add_argument("--layers", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for layers in args.layers:
        src = args.scratch / f"llama-3.2-1b-shapes-{layers}L"
        if not (src / "config.json").exists():
            t = time.time()
            write_synthetic_llama(src, **{**LLAMA_3_2_1B, "layers": layers})
            print(f"generated {src} in {time.time() - t:.0f}s", file=sys.stderr)
        shards = sorted(src.glob("*.safetensors"))
        out = args.scratch / f"{src.name}-tq{args.bits}"
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "tq_cli", "convert", str(src),
               "-o", str(out), "--bits", str(args.bits), "--overwrite", "--json"]
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                               proc.stderr).group(1))  # type: ignore[union-attr]
        summary = json.loads(proc.stdout)
        row = {"layers": layers, "model_bytes": sum(p.stat().st_size for p in shards),
               "largest_shard_bytes": max(p.stat().st_size for p in shards),
               "peak_rss_bytes": rss_kb * 1024, "seconds": round(time.time() - t, 1),
               "throughput_mb_s": summary["throughput_mb_s"]}
        row["rss_over_shard"] = round(row["peak_rss_bytes"] / row["largest_shard_bytes"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`tq bench --section kv`'s decode table for one model family and chosen contexts.

Usage: python scripts/bench_kv_family.py [--family llama|phi3] [--contexts 2048,8192]
                                         [--threads 2] [--json FILE]

A randomly initialised SmolLM2-shaped model of --family (30 layers, fp32, batch 1), every
cache holding the same random tokens, the caches taking one decode step each per round,
medians of 16 steps (`tq_cli.bench.kv.decode_rows`): transformers' DynamicCache, tq's
caches attending on the codes, and the 3.5-bit cache decoding its codes first. Phi-3 is a
family that attends on the codes through the per-layer check (`kvcache.attend.KeysProbe`)
rather than a list.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tq_cli.bench.kv import FAMILIES, decode_rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=FAMILIES, default="phi3")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = tuple(int(c) for c in args.contexts.split(","))
    rows = decode_rows(torch.device("cpu"), quick=False, family=args.family,
                       contexts=contexts, progress=lambda m: print(m, flush=True))
    for r in rows:
        print(f"{r['family']} {r['context']:>6} {r['cache']:36} {r['ms_per_token']:8.2f} ms "
              f"{r['vs_dynamic']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

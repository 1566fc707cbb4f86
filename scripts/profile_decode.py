"""Where a CPU decode token goes: tokens/s of a tq checkpoint's greedy decode, and
optionally torch.profiler's table of one generate() call.

Usage: python scripts/profile_decode.py TQ_FOLDER [--threads 1] [--tokens 64] [--profile]
           [--loop SECONDS]

Loads the checkpoint with `tq_cli.load`'s defaults (the compiled decode step on the CPU),
warms up with one generate() call (which compiles), then times --tokens greedy tokens
(EOS off, as bench_decode.py) three times and prints the best as tokens/s and ms a token.
--profile adds the operators' self-time table of one more call (tq's linear operator,
the compiled graph's own code, dynamo's cache lookup, attention, ...). --loop keeps
generating for that many seconds after the timing (after printing `looping, pid N`), for
a sampling profiler to attach to the steady state, e.g.
`perf record -F 1999 -g -p N -- sleep 15` then `perf report --no-children --sort dso,symbol`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import exactly

import tq_cli

PROMPT = "The history of the Python programming language"  # as bench_decode.py


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--loop", type=float, default=0.0, help="seconds of generating after")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model = tq_cli.load(args.folder)
    ids = AutoTokenizer.from_pretrained(args.folder)(PROMPT, return_tensors="pt").input_ids
    config = exactly(model, args.tokens)
    with torch.no_grad():
        model.generate(ids, generation_config=config)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            model.generate(ids, generation_config=config)
            best = min(best, time.perf_counter() - t)
        print(f"decode {args.tokens / best:.2f} tokens/s ({1000 * best / args.tokens:.2f} ms "
              f"a token), {args.threads} thread(s)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model.generate(ids, generation_config=config)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        if args.loop > 0:
            print(f"looping, pid {os.getpid()}", flush=True)
            end, calls = time.perf_counter() + args.loop, 0
            while time.perf_counter() < end:
                model.generate(ids, generation_config=config)
                calls += 1
            print(f"looped {calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

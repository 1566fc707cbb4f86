"""Throughput, load time and memory of a tq checkpoint against its original, both served
by the same vLLM in the same run (needs vLLM: the venv of `make vllm-test`).

    .venv-vllm/bin/python scripts/bench_vllm.py TQ_FOLDER ORIGINAL_FOLDER
        [--prompts 8] [--max-tokens 64] [--dtype float32] [--rounds 2] [--tp 1]

Each model runs in its own child process (scripts/vllm_generate.py), alternating
tq / original for `--rounds` rounds; the same text prompts, greedy, `ignore_eos`.
Reported per model: median generated tokens/s over the rounds, engine start time
(`LLM(...)`: load, profiling, KV cache and warm-up compile), vLLM's own "Loading weights
took Y seconds" and "init engine (...) took Z s" lines, and the peak of the summed PSS
(proportional set size: shared pages counted once) of the child and every process under
it (vLLM's engine core and workers), sampled every 0.2 s. The KV cache is
VLLM_CPU_KVCACHE_SPACE GiB (default here 1) in both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # a vLLM dependency

HERE = Path(__file__).resolve().parent
TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
    "Once upon a time, in a small village,", "The three primary colors are",
    "import numpy as np\n", "The theory of relativity states that",
    "A good breakfast includes", "In 1969, the first humans", "The main ingredients of bread are",
    "SELECT name FROM users WHERE", "The best way to learn a language is",
    "Photosynthesis is the process by which", "Dear hiring manager,",
    "The largest planet in the solar system", "To install the package, run",
]
LOADING = re.compile(r"Loading weights took ([\d.]+) seconds")
ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def _tree_pss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += p.memory_full_info().pss
    return total


def run(model: str, texts: Path, args: argparse.Namespace, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, str(HERE / "vllm_generate.py"), model, "--text", str(texts),
           "--tp", str(args.tp), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype,
           "--max-model-len", "1024", "--out", str(out)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    with tempfile.TemporaryFile("w+") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True)
        ps, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            peak = max(peak, _tree_pss(ps))
            time.sleep(0.2)
        logf.seek(0)
        log = logf.read()
    if proc.returncode != 0:
        sys.exit(f"bench_vllm: {model} failed:\n{log[-4000:]}")
    res = json.loads(out.read_text())
    res["peak_pss_mb"] = round(peak / 2**20, 1)
    m, e = LOADING.search(log), ENGINE.search(log)
    res["weights_load_s"] = float(m.group(1)) if m else None
    res["engine_init_s"] = float(e.group(1)) if e else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tq")
    ap.add_argument("original")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"tq": [], "original": []}
    with tempfile.TemporaryDirectory() as tmp:
        texts = Path(tmp) / "texts.json"
        texts.write_text(json.dumps((TEXTS * 8)[:args.prompts]))
        for r in range(args.rounds):
            for name, model in (("tq", args.tq), ("original", args.original)):
                res = run(model, texts, args, Path(tmp) / f"{name}-{r}.json")
                results[name].append(res)
                print(f"round {r} {name}: {res['tokens_per_s']} tok/s, start {res['load_s']} s, "
                      f"pss {res['peak_pss_mb']} MB", file=sys.stderr)
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
            "engine_start_s": statistics.median(x["load_s"] for x in runs),
            "weights_load_s": statistics.median(x["weights_load_s"] or 0 for x in runs),
            "engine_init_s": statistics.median(x["engine_init_s"] or 0 for x in runs),
            "peak_pss_mb": max(x["peak_pss_mb"] for x in runs),
            "runs": [x["tokens_per_s"] for x in runs],
        }
    same = sum(a == b for a, b in zip(results["tq"][0]["tokens"],
                                      results["original"][0]["tokens"], strict=True))
    print(json.dumps({"settings": {"prompts": args.prompts, "max_tokens": args.max_tokens,
                                   "dtype": args.dtype, "tp": args.tp, "rounds": args.rounds},
                      "tq": summary["tq"], "original": summary["original"],
                      "tq_vs_original_speed": round(summary["tq"]["tokens_per_s"]
                                                    / summary["original"]["tokens_per_s"], 3),
                      "prompts_with_identical_output": same}, indent=1))


if __name__ == "__main__":
    main()

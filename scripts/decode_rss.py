"""Where a CPU decode process's memory goes: resident memory after each stage.

Usage: python scripts/decode_rss.py TQ_FOLDER [--tokens 32] [--json FILE]

Each configuration runs in a fresh interpreter and reports VmRSS (now) and VmHWM (peak)
from /proc/self/status after: importing torch; importing transformers and tq_cli;
`tq_cli.load` (eager, and compiled); one greedy generate() of --tokens tokens (the
compiled step compiles there, so its peak holds the compiler's own memory); and a second
generate(). Compare with `scripts/bench_llamacpp.py`'s peak RSS of llama.cpp's process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, re, sys
def mem():
    s = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", s).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}
out = {}
import torch
out["import torch"] = mem()
import transformers, tq_cli
out["import transformers, tq_cli"] = mem()
folder, tokens, compile_ = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
model = tq_cli.load(folder, compile=compile_)
out["load"] = mem()
tok = transformers.AutoTokenizer.from_pretrained(folder)
ids = tok("The history of the Python programming language", return_tensors="pt").input_ids
with torch.no_grad():
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    out["first generate"] = mem()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    out["second generate"] = mem()
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report = {}
    for name, flag in (("eager", "0"), ("compiled", "1")):
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(args.folder),
                               str(args.tokens), flag], capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"decode_rss: the {name} run failed: {proc.stderr.strip()[-300:]}")
        report[name] = json.loads(line[7:])
        print(f"{name}:")
        for stage, m in report[name].items():
            print(f"  {stage:28} RSS {m['VmRSS']:7.1f} MB   peak {m['VmHWM']:7.1f} MB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

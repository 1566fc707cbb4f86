"""Conversion throughput against a plain safetensors read + write of the same bytes.

A synthetic Llama-shaped model (random bf16 weights, real layer shapes) is written to a
scratch folder, converted by `tq convert` in a child process (so its peak RSS is the
conversion's alone, read from the kernel's rusage), and copied with
`safetensors.torch.load_file`/`save_file` before and after; the gated number is the
ratio convert seconds / copy seconds from the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tq_cli.bench.metrics import Metric
from tq_cli.bench.synthetic_llama import write_synthetic_llama
from tq_cli.errors import TqError

QUICK_MODEL = {"hidden": 768, "intermediate": 2048, "layers": 2, "heads": 12, "kv_heads": 4,
               "vocab": 8192}
FULL_MODEL = {"hidden": 2048, "intermediate": 8192, "layers": 2, "heads": 32, "kv_heads": 8,
              "vocab": 32000}


class BenchChildError(TqError):
    """The child `tq convert` of the benchmark failed."""


def copy_seconds(src: Path, scratch: Path, min_s: float = 0.5) -> float:
    """Fastest of repeated load_file + save_file passes over every shard, repeated for at
    least `min_s`: a small model copies in milliseconds, too short to time once, and
    interference from elsewhere only ever adds time."""
    from safetensors.torch import load_file, save_file

    scratch.mkdir(parents=True, exist_ok=True)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        for shard in sorted(src.glob("*.safetensors")):
            save_file(load_file(shard), scratch / shard.name)
        times.append(time.perf_counter() - t)
        for p in scratch.glob("*.safetensors"):
            p.unlink()
    return min(times)


# The child reports its own peak: the kernel charges a child's ru_maxrss with the RSS of
# the process it was forked from until exec (Linux exec_mmap), so after a copy pass that
# loaded the model, wait4 would report the parent's memory. VmHWM belongs to the new image.
_CHILD = """\
import atexit, sys
def _peak():
    try:
        with open('/proc/self/status') as f:
            kb = [ln.split()[1] for ln in f if ln.startswith('VmHWM:')]
        sys.stderr.write('tq-bench-peak-kb %s\\n' % kb[0])
    except (OSError, IndexError):
        pass
atexit.register(_peak)
from tq_cli.app import main
sys.argv = ['tq'] + sys.argv[1:]
main()
"""


def convert_in_child(src: Path, out: Path, bits: int, device: torch.device,
                     extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], int]:
    """Run `tq convert --json` in a child (with `extra` options); returns its summary and
    peak RSS in bytes (its own VmHWM; rusage where /proc is missing)."""
    cmd = [sys.executable, "-c", _CHILD, "convert", str(src), "-o", str(out),
           "--bits", str(bits), "--device", device.type, "--json", "--overwrite", *extra]
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0)
        se.seek(0)
        stdout, stderr = so.read(), se.read()
    if proc.returncode != 0:
        last = [ln for ln in stderr.strip().splitlines() if not ln.startswith("tq-bench-peak-kb")]
        raise BenchChildError(f"tq convert {src} failed in the benchmark "
                              f"(exit {proc.returncode}): {(last[-1:] or ['(no output)'])[0]}")
    peaks = [int(ln.split()[1]) * 1024 for ln in stderr.splitlines()
             if ln.startswith("tq-bench-peak-kb ")]
    return json.loads(stdout), peaks[-1] if peaks else usage.ru_maxrss * 1024


def run(device: torch.device, quick: bool, scratch: Path, bits: int = 4,
        progress: Callable[[str], None] | None = None,
        ) -> tuple[list[dict[str, Any]], dict[str, Metric]]:
    tag, shape = ("quick", QUICK_MODEL) if quick else ("full", FULL_MODEL)
    src = scratch / f"synthetic-llama-{tag}"
    if progress:
        progress(f"conversion: writing a synthetic {tag} model")
    if not (src / "config.json").exists():
        write_synthetic_llama(src, hidden=shape["hidden"], intermediate=shape["intermediate"],
                              layers=shape["layers"], heads=shape["heads"],
                              kv_heads=shape["kv_heads"], vocab=shape["vocab"])
    copy_dir = scratch / "copy"
    if progress:
        progress("conversion: plain safetensors copy")
    c1 = copy_seconds(src, copy_dir)
    if progress:
        progress(f"conversion: tq convert --bits {bits} --fast ({device.type})")
    # --fast: the weight-only pipeline (read, rotate, fit, write), the part a regression
    # in tq's own code shows in; the synthetic model has no tokenizer to self-calibrate
    # with, and the default's self-calibration is timed by scripts/bench_convert.py. The
    # head as the source has it: the metrics stay those of the layers' 4-bit pipeline
    # (bits per weight, error) that the CI baseline holds.
    summary, rss = convert_in_child(src, scratch / f"{src.name}-tq{bits}", bits, device,
                                    ("--fast", "--head-bits", "none"))
    if progress:
        progress("conversion: plain safetensors copy again")
    c2 = copy_seconds(src, copy_dir)
    copy = min(c1, c2)
    source_mb = summary["source_bytes"] / 1e6
    row = {
        "model": f"llama-{tag} {shape['layers']}L h{shape['hidden']} bf16",
        "source_mb": source_mb, "bits": bits, "device": device.type,
        "convert_s": summary["seconds"], "copy_s": copy, "copy_runs_s": [c1, c2],
        "convert_mb_s": source_mb / summary["seconds"], "copy_mb_s": source_mb / copy,
        # The pipeline's time over a copy's: without the fixed-cost check against the model
        # transformers builds (reported on its own, `check_s`), which would swamp a small
        # model's ratio and hide a pipeline regression.
        "check_s": summary.get("check_seconds", 0.0),
        "convert_over_copy": (summary["seconds"] - summary.get("check_seconds", 0.0)) / copy,
        "peak_rss_mb": rss / 1e6,
        "bits_per_weight": summary["bits_per_weight"],
        "mean_rel_error": summary["mean_rel_error"],
    }
    key = f"convert.{device.type}.{tag}.{bits}bit"
    metrics = {
        f"{key}.convert_over_copy": Metric(row["convert_over_copy"], "speed"),
        f"{key}.peak_rss_mb": Metric(row["peak_rss_mb"], "memory", unit="MB"),
        f"{key}.convert_mb_s": Metric(row["convert_mb_s"], "info", "higher", "MB/s"),
        f"{key}.check_s": Metric(row["check_s"], "info", "lower", "s"),
        f"{key}.bits_per_weight": Metric(row["bits_per_weight"], "quality"),
        f"{key}.mean_rel_error": Metric(row["mean_rel_error"], "quality"),
    }
    return [row], metrics

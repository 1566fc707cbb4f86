"""Where a conversion's time goes: busy seconds per pipeline stage and per fit step.

Usage: python scripts/profile_convert.py [SOURCE] [--bits 4] [--calib FILE] [--json FILE]

Runs `convert` in this process with timers wrapped around the pipeline's steps (read,
source hashing, kept-tensor copies, input checks, rotation, each fit pass, outlier
selection, final codes + packing, writes with their hashing), and reports each step's
total seconds next to the conversion's wall time. Stages run on their own threads, so a
stage's idle time is the wall time minus its busy time. The timers cost microseconds per
call; the numbers are wall time, so a busy machine inflates them (docs/conversion-speed.md).
SOURCE defaults to SmolLM2-135M. Works on older trees too (it wraps what exists), so the
same script profiles a checkout from before a change.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUSY: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
_local = threading.local()
_lock = threading.Lock()


def _timed(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = name(*args) if callable(name) else name
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                BUSY[key] += time.perf_counter() - t
                CALLS[key] += 1
    return wrapper


def _wrap(obj: Any, attr: str, name: str | Callable[..., str]) -> None:
    if hasattr(obj, attr):
        setattr(obj, attr, _timed(name, getattr(obj, attr)))


def _pass_name(*_args: Any) -> str:
    _local.passes = getattr(_local, "passes", 0) + 1
    return f"quantize: fit pass {_local.passes}"


def _reset_passes(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _local.passes = 0
        return fn(*args, **kwargs)
    return wrapper


def instrument() -> None:
    from tq_cli.conversion import pipeline
    from tq_cli.io import writer
    from tq_cli.quant import grouped as quantizer

    _wrap(pipeline, "read_tensor", "read: read_tensor")
    _wrap(pipeline, "tensor_sha256", "read: sha256 of source")
    _wrap(writer.ShardWriter, "copy", "read: copy kept tensor (read+write+sha256)")
    _wrap(pipeline, "scan_values", "rotate: input checks")
    _wrap(pipeline, "rotate_owned", "rotate: rotation")
    _wrap(pipeline, "quantize_tensor", "quantize: whole stage")
    for cls_name in ("_Fit", "_NativeFit"):
        cls = getattr(quantizer, cls_name, None)
        if cls is None:
            continue
        cls.init_scales = _reset_passes(cls.init_scales)
        _wrap(cls, "init_scales", "quantize: initial scales")
        _wrap(cls, "iterate", _pass_name)
        _wrap(cls, "pick_outliers", "quantize: outlier selection")
        _wrap(cls, "final", "quantize: final codes + packing + error")
    _wrap(quantizer, "pack_codes", "quantize: packing (torch)")
    _wrap(writer.ShardWriter, "write", "write: pwrite + sha256 of output")
    if not hasattr(pipeline, "rotate_owned"):  # trees before the native rotation
        from tq_cli.quant.rotation import Rotation

        _wrap(Rotation, "rotate_rows", "rotate: rotation")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--calib", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    instrument()
    from tq_cli.conversion.converter import ConvertSpec, convert
    from tq_cli.quant.spec import QuantSpec

    if args.source:
        src = Path(args.source)
    else:
        from tq_cli.demo_model import smollm2_folder

        src = smollm2_folder()
    spec = ConvertSpec(quant=QuantSpec(bits=args.bits),
                       calib=str(args.calib) if args.calib else None)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        r = convert(src, Path(tmp) / "out", spec)
        wall = time.perf_counter() - t
    rows = {k: {"seconds": round(v, 3), "calls": CALLS[k], "share_of_wall": round(v / wall, 3)}
            for k, v in sorted(BUSY.items())}
    out = {"source": str(src), "bits": args.bits, "calibrated": args.calib is not None,
           "wall_s": round(wall, 3), "source_bytes": r.source_bytes, "steps": rows}
    print(f"wall {wall:.2f} s for {r.source_bytes / 1e6:.0f} MB")
    for k, v in rows.items():
        print(f"  {k:48s} {v['seconds']:8.3f} s  {v['share_of_wall']:6.1%}  ({v['calls']} calls)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time and peak memory of one tensor's calibrated fit, as `tq convert` runs it by default.

Usage: python scripts/bench_gptq_tensor.py --shape 4096 14336 [--tokens 4096] [--json F]

Builds a random weight of the given [out, in] shape (Llama-3-8B's down_proj is 4096 x
14336) and a Hessian E[x x^T] from `--tokens` random activations with heavy-tailed channel
scales, then runs `tq_cli.quant.choose.quantize_tensor` with the default spec (column
scales, Hadamard rotation, GPTQ, scale refit) exactly as the conversion pipeline's quantize
stage does, in a fresh process so its peak RSS is this fit's alone. Prints one JSON row:
seconds per stage (cProfile's cumulative times of the stage functions), wall, peak RSS and
the weighted relative error (what the manifest records).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time
from pathlib import Path

import torch

from tq_cli.quant.choose import CalibOptions, fit_weight
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec, convert_default_col_scale
from tq_kernels import isas

# Stage functions of this and earlier code (rotate_hessian, weighted_errors: an older
# checkout on PYTHONPATH reports its own), summed by name.
STAGES = ("rotate_hessian", "rotate_hessian_", "scale_hessian_", "prepare_hessian",
          "_inverse_cholesky", "_invert_lower_", "_solve", "_refit_scales", "weighted_errors",
          "fit_grid", "sinkhorn_columns")


class _OneHessian:
    """The calibration file's interface for a single tensor."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        return self.h.clone()  # the caller's copy, as tq_cli.io.calibration hands it

    def unusable(self, tensor_name: str) -> str | None:
        return None

    def group(self, tensor_name: str) -> str | None:
        return "g"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 14336])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out, n = args.shape
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, n, generator=g) * n ** -0.5
    chan = torch.exp(torch.randn(n, generator=g))  # heavy-tailed channel scales
    h = torch.zeros(n, n, dtype=torch.float64)
    for t0 in range(0, args.tokens, 1024):
        x = torch.randn(min(1024, args.tokens - t0), n, generator=g) * chan
        h += (x.T @ x).double()
    h = (h / args.tokens).float()  # stored as float32, as a calibration file holds it
    del x
    spec = convert_default_col_scale({"quant": {"bits": args.bits}})["quant"]
    spec = spec if isinstance(spec, QuantSpec) else QuantSpec(**spec)
    rot = make_rotation(RotationSpec(kind="hadamard", seed=0), n, spec.group_size)
    calib = CalibOptions(_OneHessian(h))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    res = fit_weight("w", w.clone(), spec, rot, torch.device("cpu"), calib, owned=True)
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    stages = {}
    for (_f, _l, name), (_cc, _nc, _tt, ct, _callers) in stats.items():
        if name in STAGES:
            stages[name] = round(stages.get(name, 0.0) + ct, 2)
    row = {"shape": [out, n], "tokens": args.tokens, "bits": args.bits,
           "threads": torch.get_num_threads(), "wall_s": round(wall, 2), "stages_s": stages,
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "rss_before_fit_mb": round(rss0 / 2**20),
           "weighted_rel_error": res.record.get("weighted_rel_error"),
           "rel_error": res.q.rel_error, **isas.describe()}
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

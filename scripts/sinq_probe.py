"""What SINQ's column scaling would buy tq: a fake-quantized probe, no format change.

Usage: python scripts/sinq_probe.py SOURCE OUT [--bits 4] [--iters 16] [--mode cols|none]
           [--self-calib 4096]
       tq eval OUT --reference SOURCE --max-tokens 4096 --json

SINQ (Sinkhorn-Normalized Quantization, Müller et al. 2025, arXiv:2509.22944) scales a
weight's rows and columns before the grid, found by alternately dividing rows and
columns by their standard deviation (Sinkhorn-Knopp-like), so that no row or column
dominates; the scales are stored and multiplied back. In tq every row already has its
own group scales, so a row scale changes nothing; what SINQ could add is the column
(input-channel) scale t: W = W' diag(t), with W' rotated and quantized as usual, and the
kernel would scale x by t before rotating it (a stored vector per layer, a format and
kernel change). This probe measures that before building it: every tensor tq's recipe
converts is normalised (mode `cols`), rotated, quantized with tq's weight-only fit (what
`tq convert --fast` does), dequantized, multiplied back by t, and written as fp32 into a
copy of SOURCE; mode `none` is the same path without t (it reproduces `--fast`); with
`--self-calib N` the fit is GPTQ with the random-token Hessians (tq's default), scaled
to the normalised columns (x' = x t, H' = diag(t) H diag(t)). The
scales' bytes are not counted (tq has no place for them yet): one fp16 per input column.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tq_cli.planning.prepare import plan_source
from tq_cli.quant.gptq import quantize_calibrated, rotate_hessian
from tq_cli.quant.grouped import dequantize, quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec


def sinkhorn_columns(w: torch.Tensor, iters: int) -> torch.Tensor:
    """SINQ's dual normalisation; returns the column scales t (rows are tq's groups' job).

    Alternately divide rows, then columns, by their standard deviation, in float64,
    keeping the iterate whose imbalance (largest over smallest std, rows and columns) is
    the lowest, as SINQ does."""
    x = w.double()
    log_c = torch.zeros(w.shape[1], dtype=torch.float64)
    best, best_c = float("inf"), log_c.clone()
    for _ in range(iters):
        r = x.std(dim=1, keepdim=True).clamp_min(1e-12)
        x = x / r
        c = x.std(dim=0, keepdim=True).clamp_min(1e-12)
        x = x / c
        log_c += c.log().flatten()
        rs, cs = x.std(dim=1), x.std(dim=0)
        imbalance = float(torch.cat([rs, cs]).max() / torch.cat([rs, cs]).min())
        if imbalance < best:
            best, best_c = imbalance, log_c.clone()
    return best_c.exp().float()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--mode", choices=["cols", "none"], default="cols")
    ap.add_argument("--self-calib", type=int, default=0, help="fit GPTQ-style with this many "
                    "random tokens' Hessians (tq's default: 4096), scaled as the columns are")
    args = ap.parse_args()
    planned = plan_source(args.source, None, check=args.self_calib > 0)
    calib = None
    if args.self_calib:
        import tempfile

        from tq_cli.calibration.random_tokens import synthetic_calibration
        from tq_cli.io.calibration import read_calibration

        tmp = Path(tempfile.mkdtemp())
        path, _ = synthetic_calibration(planned, args.self_calib, 0, tmp, "cpu")
        calib = read_calibration(path)
    spec = QuantSpec(bits=args.bits)
    names = set(planned.converted_names)
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.source, args.out)
    for f in sorted(args.out.glob("*.safetensors")):
        tensors = load_file(f)
        for name in sorted(names & set(tensors)):
            w = tensors[name].float()
            t = sinkhorn_columns(w, args.iters) if args.mode == "cols" else torch.ones(w.shape[1])
            rot = make_rotation(RotationSpec(kind="hadamard"), w.shape[1], spec.group_size)
            h = calib.hessian(name) if calib is not None else None
            if h is None:
                q = quantize(w / t, spec, rot)
            else:  # x' = x t, so H' = diag(t) H diag(t)
                h_t = h * t.double()[:, None] * t.double()[None, :]
                q = quantize_calibrated(rot.rotate_rows(w / t), rotate_hessian(h_t, rot), spec,
                                        rot)
            tensors[name] = (dequantize(q) * t).to(tensors[name].dtype).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    print(f"wrote {args.out} ({len(names)} tensors fake-quantized, mode {args.mode})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

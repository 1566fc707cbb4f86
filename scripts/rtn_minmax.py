"""Plain round-to-nearest with an asymmetric min-max grid per group, as a baseline.

Usage: python scripts/rtn_minmax.py SOURCE OUT [--bits 4] [--group-size 128]

Writes OUT as an ordinary safetensors model folder whose converted tensors (the same
ones the recipe converts) hold their fake-quantized values in the source dtype: per row
and group of `group-size` input columns, scale = (max - min) / (2^bits - 1), zero =
round(-min / scale), q = clamp(round(w / scale) + zero), w_hat = (q - zero) * scale. No
rotation, no outliers, no refinement: the textbook RTN that GPTQ papers compare with.
`tq eval OUT --reference SOURCE` then measures it like any model.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tq_cli.io.safetensors_reader import open_source, read_tensor
from tq_cli.planning.plan import make_plan
from tq_cli.planning.recipe import resolve_recipe
from tq_cli.quant.spec import QuantSpec, RotationSpec


def rtn_minmax(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    out, n = w.shape
    pad = (-n) % group
    x = torch.nn.functional.pad(w.float(), (0, pad)).view(out, -1, group)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if pad:  # padding zeros must not widen the last group's range
        real = torch.arange(n + pad).view(-1, group) < n
        big = torch.finfo(torch.float32).max
        lo = torch.where(real, x, big).amin(-1, keepdim=True)
        hi = torch.where(real, x, -big).amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(x / scale) + zero, 0, levels)
    return ((q - zero) * scale).view(out, -1)[:, :n].to(w.dtype).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    src = open_source(args.source)
    plan = make_plan(src, resolve_recipe(None, src.config), QuantSpec(bits=args.bits),
                     RotationSpec(kind="none"))
    converted = {t.info.name for t in plan.converted}
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, info in src.tensors.items():
        t = read_tensor(info)
        tensors[name] = rtn_minmax(t, args.bits, args.group_size) if name in converted else t
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    for p in args.source.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and \
                p.name != "model.safetensors.index.json":
            shutil.copy2(p, args.out / p.name)
    print(f"{len(converted)} tensors fake-quantized ({args.bits}-bit min-max RTN, group "
          f"{args.group_size}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

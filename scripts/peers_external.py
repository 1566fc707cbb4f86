"""Data-free peers from external tools: HQQ and bitsandbytes NF4, written out dequantized.

Usage (in a venv of its own, not the project's; see below):
    python scripts/peers_external.py SOURCE OUT_ROOT [--methods hqq,nf4,nf4-dq]
        [--group-size 64] [--tq-python PATH]
    tq eval OUT_ROOT/hqq --reference SOURCE --json        (and nf4, nf4-dq)

Tools: hqq 0.2.8.post1 and bitsandbytes 0.50.2 (its native CPU backend quantizes NF4 on
the CPU), torch 2.13.0+cpu. Venv:
    python3 -m venv /tmp/peersvenv
    /tmp/peersvenv/bin/pip install torch==2.13.0
    /tmp/peersvenv/bin/pip install hqq==0.2.8.post1 bitsandbytes==0.50.2 safetensors

Which tensors: exactly those tq's recipe converts (the plan `tq convert` makes, asked of
the project's own Python, `--tq-python`, default ROOT/.venv/bin/python): for a Llama-like
decoder the attention and MLP projections, for a BERT encoder the attention and
feed-forward dense layers. Embeddings, norms, heads and biases stay as they are (fp32).
Each weight is quantized from its fp32 values.

Methods, every one 4-bit, groups (blocks) of `group-size` consecutive input columns of a
row (with these models' widths, multiples of 64, a block never spans two rows):
- hqq: `HQQLinear` with `BaseQuantizeConfig(nbits=4, group_size=64)`, i.e. the library's
  defaults: axis=1 (groups along the input dimension; note that `Quantizer.quantize`'s own
  default is axis=0, the config's and transformers' `HqqConfig`'s is 1), asymmetric affine
  grid 0..15, min-max init with round_zero=True, then the default solver
  (`optimize_weights_proximal_legacy`: half-quadratic proximal updates of the zero point
  for an lp loss, p=0.7, beta=10, kappa=1.01, at most 20 iterations with early stop; the
  scale stays min-max), compute_dtype float16: scale and zero are stored in fp16.
  Dequantized here in fp32 from what HQQ stores: (codes - zero_fp16) * scale_fp16.
- nf4: `bitsandbytes.functional.quantize_4bit(W, blocksize=64, quant_type="nf4",
  compress_statistics=False)`: per block the absmax in fp32 and 4-bit indices into the
  16-level NF4 codebook (Dettmers et al. 2023), dequantized with `dequantize_4bit`.
- nf4-dq: the same with compress_statistics=True (QLoRA's double quantization): the
  block absmaxes, less their mean (one fp32 offset), are quantized again to 8 bits with
  bitsandbytes' dynamic map in blocks of 256, each with an fp32 absmax.

Bits per weight are counted as tq counts them (tq_cli/conversion/finish.py: every byte stored for
the converted tensors, over their number of weights): the sum, over the converted
tensors, of the bytes of every tensor the tool serialises for a weight (bitsandbytes:
`QuantState.as_dict(packed=True)` plus the packed codes; HQQ: `W_q`, `scale`, `zero` of
`HQQLinear.state_dict()`), format metadata excepted (shapes, dtype names, flags: HQQ's
scalar entries, bitsandbytes' packed JSON `quant_state.*`, where its fp32 nested offset
sits; 32 bits are added for that offset). That charges bitsandbytes for the two
constant maps it writes with every weight (the 16-entry NF4 map and the 256-entry
8-bit map, both fp32), as tq is charged for its per-tensor codebook. `bits_core` in
the JSON leaves those two maps out (codes + scales/zeros + second-level statistics).
Per weight, for a group of 64: hqq 4 + 2*16/64 = 4.5; nf4 4 + 32/64 = 4.5; nf4-dq
4 + 8/64 + 32/(64*256) = 4.127, before the per-tensor maps.

Output: OUT_ROOT/<method>/ with model.safetensors (every tensor of SOURCE under its own
name, fp32, the converted ones fake-quantized) and SOURCE's other top-level files
(config.json, tokenizer), an ordinary folder `tq eval` measures against SOURCE; and
OUT_ROOT/peers.json with, per method, bits per weight, the mean relative squared
weight error ||W - W_hat||^2 / ||W||^2 (tq's `mean_rel_error` measure, though tq
measures it in its rotated space, which an orthogonal rotation leaves unchanged) and
the time taken. Each method checks its result before saving (HQQ: against the
library's own `dequantize`; NF4: every weight over its block absmax lies on the
NF4 codebook).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("hqq", "nf4", "nf4-dq")


def converted_names(source: Path, tq_python: Path) -> list[str]:
    """The tensors `tq convert SOURCE` converts (its recipe's plan), from tq's own venv."""
    code = ("import sys, json; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
            "from tq_cli.io.safetensors_reader import open_source\n"
            "from tq_cli.planning.plan import make_plan\n"
            "from tq_cli.planning.recipe import resolve_recipe\n"
            "from tq_cli.quant.spec import QuantSpec, RotationSpec\n"
            "src = open_source(Path(sys.argv[2]))\n"
            "plan = make_plan(src, resolve_recipe(None, src.config), QuantSpec(bits=4),\n"
            "                 RotationSpec(kind='none'))\n"
            "print(json.dumps([t.info.name for t in plan.converted]))\n")
    out = subprocess.run([str(tq_python), "-c", code, str(ROOT), str(source)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quant_hqq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, float, float]:
    """HQQ 4-bit with the library defaults; (w_hat fp32, bits stored, bits core)."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear, Quantizer

    cfg = BaseQuantizeConfig(nbits=4, group_size=group)
    assert cfg["weight_quant_params"]["axis"] == 1
    layer = HQQLinear.from_weights(w.clone(), None, cfg, compute_dtype=torch.float16,
                                   device="cpu", del_orig=True)
    meta = layer.meta
    scale, zero = meta["scale"], meta["zero"]
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    assert not meta["quant_scale"] and not meta["quant_zero"]
    codes = Quantizer.unpack[meta["packing"]](layer.W_q, dtype=torch.float32)
    w_hat = ((codes - zero.float()) * scale.float()).reshape(w.shape)
    lib = layer.dequantize().float()  # the library's own (fp16 arithmetic)
    off = float((lib - w_hat).abs().max() / w_hat.abs().max().clamp(min=1e-12))
    if off > 2e-3:
        raise SystemExit(f"hqq: our dequantization differs from hqq's by {off:.2e}")
    bits = 8.0 * (nbytes(layer.W_q) + nbytes(scale) + nbytes(zero))
    return w_hat.contiguous(), bits, bits


def quant_nf4(w: torch.Tensor, group: int, double: bool) -> tuple[torch.Tensor, float, float]:
    """bitsandbytes NF4, blocks of `group`; (w_hat fp32, bits stored, bits core)."""
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit(w, blocksize=group, compress_statistics=double,
                                  quant_type="nf4")
    w_hat = bnbf.dequantize_4bit(q, state).float().reshape(w.shape)
    stored = {k: v for k, v in state.as_dict(packed=True).items()
              if isinstance(v, torch.Tensor) and not k.startswith("quant_state.")}
    bits = 8.0 * (nbytes(q) + sum(nbytes(v) for v in stored.values()))
    if double:
        bits += 32  # state.offset, serialised inside the packed JSON
    maps = sum(nbytes(stored[k]) for k in ("quant_map", "nested_quant_map") if k in stored)
    # check: every weight over its block's (dequantized) absmax is an NF4 level
    absmax = w_hat.reshape(-1, group).abs().amax(-1, keepdim=True).clamp(min=1e-30)
    z = w_hat.reshape(-1, group) / absmax
    code = state.code.float()
    off = float((z[..., None] - code).abs().amin(-1).max())
    if off > 1e-5:
        raise SystemExit(f"nf4: a weight lies {off:.2e} off the NF4 codebook")
    return w_hat.contiguous(), bits, bits - 8.0 * maps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out_root", type=Path)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tq-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")

    names = set(converted_names(args.source, args.tq_python))
    source: dict[str, torch.Tensor] = {}
    for f in sorted(args.source.glob("*.safetensors")):
        with safe_open(f, "pt") as src:
            for name in src.keys():  # noqa: SIM118 (safe_open is not a dict)
                source[name] = src.get_tensor(name)
    missing = names - set(source)
    if missing:
        raise SystemExit(f"tensors of the plan not in the source: {sorted(missing)[:5]}")
    numel = sum(source[n].numel() for n in names)
    print(f"{len(names)} tensors to quantize, {numel} weights, of {len(source)}")

    report: dict = {"source": str(args.source), "group_size": args.group_size,
                    "tensors": len(names), "weights": numel, "methods": {}}
    results_path = args.out_root / "peers.json"
    if results_path.exists():
        report["methods"] = json.loads(results_path.read_text()).get("methods", {})
    for method in methods:
        t0 = time.time()
        out: dict[str, torch.Tensor] = {}
        bits = core = 0.0
        errs = []
        for name, t in source.items():
            w = t.detach().to(torch.float32).contiguous()
            if name in names:
                if method == "hqq":
                    w_hat, b, c = quant_hqq(w, args.group_size)
                else:
                    w_hat, b, c = quant_nf4(w, args.group_size, method == "nf4-dq")
                bits += b
                core += c
                errs.append(float((w - w_hat).pow(2).sum() / w.pow(2).sum().clamp(min=1e-30)))
                w = w_hat
            out[name] = w.clone()
        seconds = time.time() - t0
        folder = args.out_root / method
        folder.mkdir(parents=True, exist_ok=True)
        save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
        for f in args.source.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copy2(f, folder / f.name)
        row = {"folder": str(folder), "bits_per_weight": bits / numel,
               "bits_core": core / numel, "mean_rel_error": sum(errs) / len(errs),
               "max_rel_error": max(errs), "seconds": round(seconds, 1)}
        report["methods"][method] = row
        print(f"{method}: {row['bits_per_weight']:.4f} bits/weight "
              f"({row['bits_core']:.4f} without per-tensor constant maps), mean rel. error "
              f"{row['mean_rel_error']:.3e}, {seconds:.1f} s -> {folder}")
        args.out_root.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

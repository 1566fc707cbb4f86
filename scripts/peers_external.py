"""Peers from external tools: HQQ, bitsandbytes NF4, SINQ and AutoRound, written out dequantized.

Usage (each method in a venv of its own, not the project's; see below):
    python scripts/peers_external.py SOURCE OUT_ROOT [--methods hqq,nf4,nf4-dq,sinq,autoround]
        [--group-size 64] [--tq-python PATH]
        [--autoround-group-size 128] [--autoround-iters 200]
        [--calib-samples 128] [--calib-seqlen 512]
    tq eval OUT_ROOT/hqq --reference SOURCE --json        (and nf4, nf4-dq, sinq, autoround)
Run it once per venv, with the methods that venv has, on the same OUT_ROOT: peers.json
keeps the rows of earlier runs.

Tools, all on torch 2.13.0+cpu (the local CPU wheel):
- hqq 0.2.8.post1 and bitsandbytes 0.50.2 (its native CPU backend quantizes NF4 on the
  CPU). Venv:
    python3 -m venv /tmp/peersvenv
    /tmp/peersvenv/bin/pip install torch==2.13.0
    /tmp/peersvenv/bin/pip install hqq==0.2.8.post1 bitsandbytes==0.50.2 safetensors
- sinq 0.2.0 (Muller et al. 2025, Sinkhorn-Normalized Quantization). Its wheel requires
  GPU-only and evaluation extras (gemlite==0.5.1.post1, torchaudio, torchvision,
  lm_eval, hf_transfer) that the quantizer never imports, so it goes in with --no-deps;
  `datasets` is needed only because sinq/awq.py imports it at module level. The wheel
  also installs site-packages/sitecustomize.py, which at every interpreter start of the
  venv imports sinq._autopatch -> sinq.hf_io (huggingface_hub, transformers,
  sinq.patch_model) and monkey-patches transformers' PreTrainedModel.save_pretrained,
  push_to_hub and from_pretrained to route SINQ-flagged models through SINQ's own I/O
  (SINQ_AUTO_PATCH=0 turns it off); without transformers in the venv it prints
  "[SINQ] autopatch failed: No module named 'transformers'" on every start. It is of no
  use here and is removed from this venv:
    python3 -m venv /tmp/sinqvenv
    /tmp/sinqvenv/bin/pip install torch==2.13.0
    /tmp/sinqvenv/bin/pip install numpy termcolor datasets safetensors
    /tmp/sinqvenv/bin/pip install --no-deps sinq==0.2.0
    rm /tmp/sinqvenv/lib/python3.11/site-packages/sitecustomize.py
- auto-round 0.16.1 (Intel's AutoRound, Cheng et al., SignRound), with its own deps
  (transformers 5.25.0, accelerate, datasets):
    python3 -m venv /tmp/arvenv
    /tmp/arvenv/bin/pip install torch==2.13.0
    /tmp/arvenv/bin/pip install auto-round==0.16.1 safetensors

Which tensors: exactly those tq's recipe converts (the plan `tq convert` makes, asked of
the project's own Python, `--tq-python`, default ROOT/.venv/bin/python): for a Llama-like
decoder the attention and MLP projections, for a BERT encoder the attention and
feed-forward dense layers. Embeddings, norms, heads and biases stay as they are (fp32).
Each weight is quantized from its fp32 values.

Methods, every one 4-bit, groups (blocks) of `group-size` (64) consecutive input columns of
a row (with these models' widths, multiples of 64, a block never spans two rows), but
AutoRound's of `--autoround-group-size` (128, its default); all but AutoRound data-free:
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
- sinq: `sinq.sinqlinear.SINQLinear(nn.Linear(W), BaseQuantizeConfig(nbits=4,
  group_size=64, tiling_mode="1D", method="sinq"), device="cpu")`, the README's
  recommended setting ("SINQ g64"); method "sinq" is remapped by the config to
  "sinq_quantAux". Per tile of 64 input columns x all rows, a Sinkhorn-style
  normalisation (`sinkhorn_log`, 16 steps, keeps the least imbalanced step) finds a
  scale per column (mu1) and per row (mu2); the normalised tile is quantized
  round-to-nearest, asymmetric, grid 0..15, min-max per group of 64 (one row of the
  tile); the row scale is folded into the group scale and the column scale kept as
  `scale2`. A tensor whose kurtosis exceeds 5 is quantized by plain RTN instead (SINQ's
  own gate, taken by 51 of SmolLM2's 210 tensors and 7 of MiniLM's 36; counted in the JSON
  as `rtn_fallback`; `scale2` is then all ones). "quantAux": the group scales are then
  quantized to 8 bits (uint8, with an fp16 scale and minimum per 32 groups) and the
  group zeros to 8 bits (one fp16 scale and minimum per tensor). The solver runs in
  fp16 and stores fp16, as on a GPU: `optimize_weights_proximal_legacy` picks fp32 only
  for `device == "cpu"`, and SINQLinear passes a torch.device, which never equals a
  string. Dequantized here in fp32 from what SINQ stores:
  (codes - z) * s * scale2, with s and z rebuilt from their 8-bit codes in fp32, and
  checked against SINQ's own `dequantize`.
- autoround: `auto_round.AutoRound(model, tokenizer, scheme="W4A16", iters=ITERS,
  dataset=ROWS, nsamples=len(ROWS), seqlen=512, device_map="cpu")` then
  `quantize_and_save(DIR, format="auto_round")`: SignRound, symmetric int4 (zero point
  8) in groups of 128 input columns (W4A16, the default scheme), block by block: each
  block's rounding offsets and min/max clipping are tuned by signed gradient descent
  on the MSE between the block's output and the fp block's output on the calibration
  rows (lr 1/iters, batch 8, best iteration kept, AMP in bf16 on CPU, torch.compile on),
  the next block fed the quantized block's output. ROWS are `tq calibrate`'s own: the
  project's calibration text (`tq_cli.io.text.calibration_text()`, asked of
  `--tq-python`) tokenised once and cut into up to --calib-samples (128) consecutive rows
  of --calib-seqlen (512) tokens (SmolLM2: 97 rows, MiniLM: 104). AutoRound quantizes
  every Linear inside the transformer blocks; for these models that is exactly tq's
  converted set (the script refuses a plan tensor it did not quantize, and leaves any
  other tensor it quantized at its source value). A row of 576 columns has groups
  128,128,128,128,64 (the last group zero-padded when quantized). What it stores
  ("auto_round:auto_gptq" packing): int32 `qweight` (8 codes per word), int32 `qzeros`
  (zero point - 1, 8 per word) and fp16 `scales`, per group and output row; dequantized
  here in fp32 as (code - zero) * scale and checked against its own torch kernel
  (auto_round_extension.torch.qlinear_torch_zp.QuantLinear) where the row length is a
  multiple of the group (that kernel cannot take the partial last group).
  AutoRound's default is iters=200; on one core (nice, taskset, OMP_NUM_THREADS=1)
  SmolLM2-135M took ~78 s per block at 200 iterations with the 97 rows, ~40 minutes for
  its 30 blocks, so it was run with --autoround-iters 100 (17.4 minutes; lr 1/100);
  MiniLM with the default 200 (5.5 minutes) and with 100. AutoRound runs the BERT
  encoder as it is (blocks encoder.layer.N; the pooler is left out, as tq leaves it).

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
4 + 8/64 + 32/(64*256) = 4.127, before the per-tensor maps. SINQ: `W_q`, the 8-bit
scale and zero codes, their fp16 scales and minima, and `scale2` (its per-column scale,
fp16; `awq_scale` is None without calibration): 4 + 8/64 + 8/64 + 32/(32*64) + 16/rows
~ 4.28. AutoRound: `qweight`, `qzeros`, `scales`: 4 + 16/128 + 4/128 = 4.156 for rows of a
multiple of 128 columns, more where the last group is partial (576 = 5 groups). Its
zero points are all 8 (symmetric) but stored all the same, so they are counted.

Output: OUT_ROOT/<method>/ with model.safetensors (every tensor of SOURCE under its own
name, fp32, the converted ones fake-quantized) and SOURCE's other top-level files
(config.json, tokenizer), an ordinary folder `tq eval` measures against SOURCE; and
OUT_ROOT/peers.json with, per method, bits per weight, the mean relative squared
weight error ||W - W_hat||^2 / ||W||^2 (tq's `mean_rel_error` measure, though tq
measures it in its rotated space, which an orthogonal rotation leaves unchanged) and
the time taken (AutoRound: the whole calibrated run, export included). Each method checks
its result before saving (HQQ and SINQ: against the library's own `dequantize`; NF4:
every weight over its block absmax lies on the NF4 codebook; AutoRound: against its
torch kernel, and every zero point is 8).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("hqq", "nf4", "nf4-dq", "sinq", "autoround")


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


def quant_sinq(w: torch.Tensor, group: int, notes: dict) -> tuple[torch.Tensor, float, float]:
    """SINQ 4-bit, 1D tiling, method "sinq"; (w_hat fp32, bits stored, bits core)."""
    from sinq.optimize import kurtosis
    from sinq.sinqlinear import BaseQuantizeConfig, SINQLinear

    cfg = BaseQuantizeConfig(nbits=4, group_size=group, tiling_mode="1D", method="sinq")
    assert cfg["weight_quant_params"]["method"] == "sinq_quantAux"
    assert cfg["weight_quant_params"]["axis"] == 1
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    layer = SINQLinear(lin, cfg, compute_dtype=torch.float32, device="cpu")
    meta = layer.meta
    # SINQ's kurtosis gate (opt_params["kurtosis_threshold"] = 5.0, on the fp16 weight)
    if float(kurtosis(w.to(torch.float16))) > 5.0:
        notes["rtn_fallback"] = notes.get("rtn_fallback", 0) + 1
    assert meta["packing"] == "4bit_u8" and meta["awq_scale"] is None
    sx, ss, sm, _ = meta["scale"]  # 8-bit group scales: codes, scale and min per 32 groups
    zx, zs, zm, _ = meta["zero"]  # 8-bit group zeros: codes, one scale and min
    scale2 = meta["scale2"]  # per input column
    scale = (sx.float() * ss.float() + sm.float()).reshape(-1, 1)
    zero = (zx.float() * zs.float() + zm.float()).reshape(-1, 1)
    codes = layer.unpack(dtype=torch.float32)[: scale.shape[0]]
    w_hat = ((codes - zero) * scale).reshape(w.shape) * scale2.float()
    lib = layer.dequantize().float()  # the library's own (fp16 scale/zero rebuild)
    off = float((lib - w_hat).abs().max() / w_hat.abs().max().clamp(min=1e-12))
    if off > 2e-3:
        raise SystemExit(f"sinq: our dequantization differs from sinq's by {off:.2e}")
    stored = [layer.W_q, sx, ss, sm, zx, zs, zm, scale2]
    bits = 8.0 * sum(nbytes(t) for t in stored)
    return w_hat.contiguous(), bits, bits


def calibration_rows(source: Path, tq_python: Path, samples: int, seqlen: int) -> torch.Tensor:
    """`tq calibrate`'s rows: its calibration text tokenised once, cut into rows of seqlen."""
    from transformers import AutoTokenizer

    text = subprocess.run(
        [str(tq_python), "-c", "import sys; sys.path.insert(0, sys.argv[1])\n"
         "from tq_cli.io.text import calibration_text\n"
         "sys.stdout.write(calibration_text().text)", str(ROOT)],
        check=True, capture_output=True, text=True).stdout
    tok = AutoTokenizer.from_pretrained(source)
    ids = torch.tensor(tok(text, verbose=False)["input_ids"], dtype=torch.long)
    n = min(ids.numel() // seqlen, samples)
    if n == 0:
        raise SystemExit(f"calibration text: {ids.numel()} tokens, fewer than {seqlen}")
    return ids[: n * seqlen].reshape(n, seqlen)


def unpack_int32(q: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit codes packed 8 to an int32 (lowest nibble first) along `dim`, unpacked."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:  # qweight [in/8, out] -> [in, out]
        u = (q.unsqueeze(1) >> shifts.view(1, -1, 1)) & 15
        return u.reshape(-1, q.shape[1])
    u = (q.unsqueeze(2) >> shifts.view(1, 1, -1)) & 15  # qzeros [groups, out/8]
    return u.reshape(q.shape[0], -1)


def quant_autoround(source: Path, names: set[str], group: int, iters: int, rows: torch.Tensor,
                    notes: dict) -> dict[str, tuple[torch.Tensor, float, float]]:
    """AutoRound W4A16 on the whole model; per plan tensor (w_hat fp32, bits, bits core)."""
    import transformers
    from auto_round import AutoRound
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    arch = (json.loads((source / "config.json").read_text()).get("architectures") or [""])[0]
    auto = (transformers.AutoModelForCausalLM if arch.endswith("ForCausalLM")
            else transformers.AutoModel)
    model = auto.from_pretrained(source, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(source)
    with tempfile.TemporaryDirectory(prefix="autoround-") as tmp:
        ar = AutoRound(model, tok, scheme="W4A16", group_size=group, iters=iters,
                       dataset=[r[None] for r in rows], nsamples=rows.shape[0],
                       seqlen=rows.shape[1], device_map="cpu")
        ar.quantize_and_save(tmp, format="auto_round")
        files = sorted(Path(tmp).rglob("*.safetensors"))
        qcfg = json.loads(next(Path(tmp).rglob("quantization_config.json")).read_text())
        stored: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(f, "pt") as src:
                for k in src.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if k.endswith((".qweight", ".qzeros", ".scales")):
                        stored[k] = src.get_tensor(k)
    if (qcfg.get("bits"), qcfg.get("group_size"), qcfg.get("sym")) != (4, group, True):
        raise SystemExit(f"autoround: unexpected quantization_config {qcfg}")
    notes["packing_format"] = qcfg.get("packing_format")
    quantized = {k.removesuffix(".qweight") + ".weight" for k in stored if k.endswith(".qweight")}
    if names - quantized:
        missing = sorted(names - quantized)[:5]
        raise SystemExit(f"autoround left plan tensors unquantized: {missing}")
    notes["quantized_outside_plan"] = sorted(quantized - names)
    out = {}
    checked = 0
    for name in sorted(names):
        base = name.removesuffix(".weight")
        qw, qz, sc = (stored[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales"))
        codes = unpack_int32(qw, 0).float()  # [in, out]
        zero = unpack_int32(qz, 1).float() + 1  # stored as zero - 1
        if not bool((zero == 8).all()):
            raise SystemExit(f"autoround: {name}: a zero point is not 8 (symmetric int4)")
        g = torch.arange(codes.shape[0]) // group
        w_hat = ((codes - zero[g]) * sc.float()[g]).t().contiguous()
        if codes.shape[0] % group == 0:  # its torch kernel assumes whole groups
            ql = QuantLinear(4, group, codes.shape[0], codes.shape[1], bias=False)
            ql.qweight, ql.qzeros, ql.scales = qw, qz, sc
            lib = ql(torch.eye(codes.shape[0], dtype=torch.float32)).t()
            # the kernel multiplies scale by (code - zero) in fp16: one fp16 rounding
            off = float(((lib - w_hat).abs() / w_hat.abs().clamp(min=1e-30)).max())
            if off > 2.0**-10:
                raise SystemExit(f"autoround: our dequantization differs from its kernel's "
                                 f"by {off:.2e} relative ({name})")
            checked += 1
        bits = 8.0 * (nbytes(qw) + nbytes(qz) + nbytes(sc))
        out[name] = (w_hat, bits, bits)
    notes["checked_against_kernel"] = checked
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out_root", type=Path)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tq-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    ap.add_argument("--autoround-group-size", type=int, default=128)
    ap.add_argument("--autoround-iters", type=int, default=200)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seqlen", type=int, default=512)
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
        notes: dict = {}
        group = args.autoround_group_size if method == "autoround" else args.group_size
        whole: dict[str, tuple[torch.Tensor, float, float]] = {}
        if method == "autoround":
            rows = calibration_rows(args.source, args.tq_python, args.calib_samples,
                                    args.calib_seqlen)
            notes.update(iters=args.autoround_iters, calib_rows=rows.shape[0],
                         calib_seqlen=rows.shape[1])
            whole = quant_autoround(args.source, names, group, args.autoround_iters, rows,
                                    notes)
        for name, t in source.items():
            w = t.detach().to(torch.float32).contiguous()
            if name in names:
                if method == "autoround":
                    w_hat, b, c = whole[name]
                elif method == "hqq":
                    w_hat, b, c = quant_hqq(w, group)
                elif method == "sinq":
                    w_hat, b, c = quant_sinq(w, group, notes)
                else:
                    w_hat, b, c = quant_nf4(w, group, method == "nf4-dq")
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
        row = {"folder": str(folder), "group_size": group, "bits_per_weight": bits / numel,
               "bits_core": core / numel, "mean_rel_error": sum(errs) / len(errs),
               "max_rel_error": max(errs), "seconds": round(seconds, 1), **notes}
        report["methods"][method] = row
        print(f"{method}: {row['bits_per_weight']:.4f} bits/weight "
              f"({row['bits_core']:.4f} without per-tensor constant maps), mean rel. error "
              f"{row['mean_rel_error']:.3e}, {seconds:.1f} s -> {folder}")
        args.out_root.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

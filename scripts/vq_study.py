"""Would vector codes beat tq's scalar codebook at 3 bits? A study on a Llama-like causal LM.

Usage (the project's venv):
    python scripts/vq_study.py SOURCE [--bits 3] [--dims 1,2,4] [--data sampled|random]
        [--tokens 8192] [--json OUT.json]

Every converted layer of SOURCE is prepared as `tq convert` prepares it (column scales
and rotation: `prepare_weight`; its H from the original model's activations on the
conversion's own calibration tokens, scaled and rotated the same way), then quantized
with codes of `dims` consecutive rotated columns at once: one codebook per tensor of
2^(bits * dims) points in `dims` dimensions (k-means on the weights over their group
scale), one scale per row and group of 128 columns (the group's root mean square), and
GPTQ's error feedback over `dims` columns at a time, each code chosen to minimise the
error GPTQ carries forward, ||(w - s c) U_bb^-1||^2 with U_bb the block of the inverse
Hessian's Cholesky factor (GPTVQ: van Baalen et al. 2024, arXiv:2402.15319, without its
per-group codebooks, codebook updates or SVD compression). `dims = 1` is the same simple
recipe with scalar codes, the like-for-like baseline: the difference between the rows is
what vector codes give, at the same bits per weight (a per-tensor codebook costs at most
4096 x 4 fp16 values). KL, perplexity and top-1 as `tq eval` measures them (4096 tokens,
context 512); the head stays in float32. Nothing is written but the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

GROUP = 128
KMEANS_SAMPLES = 1 << 17
KMEANS_STEPS = 25


def _nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    return torch.cat([torch.cdist(x[r:r + chunk], c).argmin(1)
                      for r in range(0, x.shape[0], chunk)])


def kmeans(x: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """k centroids of the rows of x: Lloyd's algorithm on a random sample of the rows
    (KMEANS_SAMPLES of them, or 16 per centroid where that is more), half the steps for
    codebooks of more than 256 points."""
    gen = torch.Generator().manual_seed(seed)
    samples = min(x.shape[0], max(KMEANS_SAMPLES, 16 * k))
    x = x[torch.randperm(x.shape[0], generator=gen)[:samples]]
    c = x[torch.randperm(x.shape[0], generator=gen)[:k]].clone()
    for _ in range(KMEANS_STEPS if k <= 256 else KMEANS_STEPS // 2):
        near = _nearest(x, c)
        sums = torch.zeros_like(c).index_add_(0, near, x)
        counts = torch.bincount(near, minlength=k).float()
        c = torch.where((counts == 0)[:, None], c, sums / counts.clamp(min=1)[:, None])
    return c


def gptq_vq(w: torch.Tensor, up: torch.Tensor, dims: int, bits: int,
            block: int = 128) -> torch.Tensor:
    """W_hat [out, n] of the rotated weight w under `dims`-dimensional codes."""
    out, n = w.shape
    assert n % dims == 0 and GROUP % dims == 0 and block % dims == 0
    w = w.clone()
    gidx = torch.arange(n) // GROUP  # the last group may be shorter, as tq's
    sq = torch.zeros(out, int(gidx[-1]) + 1).index_add_(1, gidx, w.pow(2))
    s = (sq / torch.bincount(gidx).float()).sqrt().clamp(min=1e-12)  # [out, groups]
    sc = s[:, gidx]
    cb = kmeans((w / sc).reshape(-1, dims), 1 << (bits * dims))  # [k, dims]
    w_hat = torch.empty_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        err = torch.empty(out, i2 - i1)
        for j in range(i1, i2, dims):
            cols = slice(j, j + dims)
            minv = torch.linalg.inv(up[cols, cols])  # the block's inverse, [dims, dims]
            wm = w[:, cols] @ minv  # [out, dims]
            cm = cb @ minv  # [k, dims]
            srow = sc[:, j:j + 1]  # one group holds the whole code
            dist = -2 * srow * (wm @ cm.T) + srow.pow(2) * cm.pow(2).sum(1)[None]
            q = cb[dist.argmin(1)] * srow
            w_hat[:, cols] = q
            e = (w[:, cols] - q) @ minv
            err[:, j - i1:j - i1 + dims] = e
            if j + dims < i2:
                w[:, j + dims:i2] -= e @ up[cols, j + dims:i2]
        if i2 < n:
            w[:, i2:] -= err @ up[i1:i2, i2:]
    return w_hat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--dims", default="1,2,4")
    ap.add_argument("--data", choices=["random", "sampled"], default="sampled")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tq_cli.calibration.random_tokens import self_calibration_ids
    from tq_cli.calibration.skeleton import catch_block_inputs, with_hidden
    from tq_cli.evaluation.compare import causal_metrics
    from tq_cli.io.text import evaluation_text
    from tq_cli.planning.prepare import plan_source
    from tq_cli.quant.colscale import scale_hessian_
    from tq_cli.quant.gptq import prepare_hessian, rotate_hessian_
    from tq_cli.quant.prepare import prepare_weight
    from tq_cli.quant.rotation import make_rotation
    from tq_cli.quant.spec import CONVERT_COL_SCALE, QuantSpec, RotationSpec

    sys.path.insert(0, str(Path(__file__).parent))
    from sequential_study import STAGES, collect

    torch.manual_seed(0)
    quant = QuantSpec(bits=args.bits, col_scale=CONVERT_COL_SCALE)
    planned = plan_source(args.source, None, quant, RotationSpec())
    plans = {t.info.name: t for t in planned.plan.converted if not t.head}
    seqs, record = self_calibration_ids(planned, args.tokens, 0, "cpu",
                                        sampled=args.data == "sampled")
    tok = AutoTokenizer.from_pretrained(args.source)
    ref = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    ids = torch.tensor(tok(evaluation_text().text)["input_ids"][:4096])
    dims = [int(d) for d in args.dims.split(",")]
    cands = {d: copy.deepcopy(ref) for d in dims}
    seconds = dict.fromkeys(dims, 0.0)
    every = [p for stage in STAGES for p in stage]
    with torch.no_grad():
        fp_in = catch_block_inputs(ref, ref.model.layers[0], seqs, args.batch,
                                   torch.device("cpu"))
        for i, fb in enumerate(ref.model.layers):
            hs, outs = collect(fb, fp_in, every)
            for p in every:
                name = f"model.layers.{i}.{p}.weight"
                tp = plans[name]
                w = fb.get_submodule(p).weight.detach().clone()
                rot = make_rotation(tp.rotation, w.shape[1], tp.block)
                prep = prepare_weight(w, tp.quant, rot)
                h = hs[p].clone()
                if prep.col_scale is not None:
                    h = scale_hessian_(h, prep.col_scale)
                h = rotate_hessian_(h, rot)
                up = prepare_hessian(h, damp=0.01).up.float()
                for d in dims:
                    t0 = time.perf_counter()
                    w_hat = rot.unrotate(gptq_vq(prep.w_rot.float(), up, d, args.bits))
                    if prep.col_scale is not None:
                        w_hat = w_hat * prep.col_scale.float()
                    cands[d].model.layers[i].get_submodule(p).weight.copy_(w_hat)
                    seconds[d] += time.perf_counter() - t0
            fp_in = [with_hidden(a, k, y) for (a, k), y in zip(fp_in, outs, strict=True)]
            print(f"block {i} done", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"source": args.source, "bits": args.bits, "data": args.data,
                              "calibration": record, "dims": {}}
    for d in dims:
        m = causal_metrics(ref, cands[d], ids, 512, None)
        result["dims"][str(d)] = {"fit_seconds": seconds[d], **m}
        print(f"dims {d}: KL {m['kl_mean']:.4f} perplexity {m['candidate_perplexity']:.2f} "
              f"top-1 {m['top1_agreement']:.4f} ({seconds[d]:.0f} s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

"""Block-output tuning of a tq checkpoint's group scales, AutoRound-style: does it help?

Usage (the project's venv):
    python scripts/tune_study.py CHECKPOINT --reference SOURCE [--data sampled|random]
        [--steps 64] [--lr 5e-3] [--batch 2] [--tokens 8192] [--json OUT.json]

What it does, in memory (nothing is written to CHECKPOINT):
- every converted layer of CHECKPOINT becomes W(a) = a (x) B + C: B its dequantized
  codes times their group scales, C its outliers, both in the original basis with the
  column scales applied, and a = exp(beta) one factor per (row, group), beta = 0 at
  the start. The rotation is a Hadamard per block of the group size, so a group's
  factor commutes with it; CHECKPOINT must have been converted with the rotation block
  equal to the group size (tq's default), and the script refuses otherwise;
- block by block, beta is tuned so that the block, fed the outputs of the blocks
  already tuned, reproduces the original block's output on the original model's own
  inputs (mean squared error), with signed gradient steps (AutoRound's SignSGD: Cheng
  et al. 2023, "Optimize Weight Rounding via Signed Gradient Descent for the
  Quantization of LLMs", arXiv:2309.05516); `--steps` steps of `--batch` sequences,
  cycling over the calibration sequences;
- the calibration sequences are what `tq convert` itself uses without data: random
  tokens (`--data random`, the default self-calibration's text) or text the original
  model samples from a random first token (`--data sampled`, `--self-calib sampled`'s);
- KL, perplexity and top-1 against SOURCE on tq's evaluation text (context 512, the
  first 4096 tokens, the windows `tq eval` uses: `causal_metrics`) before and after.

A stored head is dequantized and left as it is. Only causal LMs with a `model.layers`
stack (Llama-like) are handled.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ScaledLinear(nn.Module):
    """A converted layer whose group scales carry a trainable factor exp(beta)."""

    def __init__(self, q: Any, bias: torch.Tensor | None) -> None:
        from tq_cli.quant.grouped import dequantize

        super().__init__()
        full = dequantize(q)
        plain = dequantize(replace(q, outlier_idx=q.outlier_idx[:0],
                                   outlier_val=q.outlier_val[:0]))
        self.register_buffer("b", plain)
        self.register_buffer("c", full - plain)
        self.group = q.spec.group_size
        self.beta = nn.Parameter(torch.zeros(q.shape[0], -(-q.shape[1] // self.group)))
        self.bias = bias

    def weight(self) -> torch.Tensor:
        a = torch.exp(self.beta).repeat_interleave(self.group, dim=1)[:, :self.b.shape[1]]
        return self.b * a + self.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)


def quantized_model(ref: nn.Module, checkpoint: Path) -> nn.Module:
    """A copy of `ref` with every converted layer of `checkpoint` in place."""
    from tq_cli.io.checkpoint import Checkpoint
    from tq_cli.quant.grouped import dequantize

    ck = Checkpoint(checkpoint)
    cand = copy.deepcopy(ref)
    for name in ck.converted:
        q = ck.quantized(name)
        block = q.rotation.block if q.rotation.kind == "hadamard" else None
        path = name.removesuffix(".weight")
        parent, _, leaf = path.rpartition(".")
        target = cand.get_submodule(path)
        if leaf == "lm_head" or isinstance(target, nn.Embedding):  # the stored head
            head = nn.Linear(q.shape[1], q.shape[0], bias=False)
            head.weight = nn.Parameter(dequantize(q), requires_grad=False)
            cand.lm_head = head
            cand.config.tie_word_embeddings = False
            continue
        if block != q.spec.group_size:
            sys.exit(f"{checkpoint}: '{name}' has rotation {q.rotation.kind} block {block} "
                     f"and groups of {q.spec.group_size}; the study needs a Hadamard rotation "
                     "per group")
        setattr(cand.get_submodule(parent), leaf, ScaledLinear(q, target.bias))
    for p in cand.parameters():
        p.requires_grad_(False)
    return cand


def _out(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple | list) else y


def _mse(block: nn.Module, inputs: list[tuple[tuple, dict]],
         targets: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(F.mse_loss(_out(block(*a, **k)), t))
                   for (a, k), t in zip(inputs, targets, strict=True)) / len(inputs)


def tune(ref: nn.Module, cand: nn.Module, seqs: torch.Tensor, steps: int, lr: float,
         batch: int) -> list[dict[str, float]]:
    """Tune every block's factors in turn; per block the mean squared error before and
    after."""
    from tq_cli.calibration.skeleton import catch_block_inputs, with_hidden

    with torch.no_grad():
        fp_in = catch_block_inputs(ref, ref.model.layers[0], seqs, batch, torch.device("cpu"))
    q_in = list(fp_in)
    rows = []
    for i, (fb, qb) in enumerate(zip(ref.model.layers, cand.model.layers, strict=True)):
        with torch.no_grad():
            targets = [_out(fb(*a, **k)) for a, k in fp_in]

        before = _mse(qb, q_in, targets)
        params = [m.beta for m in qb.modules() if isinstance(m, ScaledLinear)]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.SGD(params, lr=lr)
        for s in range(steps):
            a, k = q_in[s % len(q_in)]
            loss = F.mse_loss(_out(qb(*a, **k)), targets[s % len(q_in)])
            opt.zero_grad()
            loss.backward()
            for p in params:
                assert p.grad is not None
                p.grad.sign_()
            opt.step()
        for p in params:
            p.requires_grad_(False)
        rows.append({"block": i, "mse_before": before, "mse_after": _mse(qb, q_in, targets)})
        with torch.no_grad():
            for j, (a, k) in enumerate(fp_in):
                fp_in[j] = with_hidden(a, k, targets[j])
            for j, (a, k) in enumerate(q_in):
                q_in[j] = with_hidden(a, k, _out(qb(*a, **k)))
        print(f"block {i}: mse {before:.4g} -> {rows[-1]['mse_after']:.4g}", file=sys.stderr,
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--data", choices=["random", "sampled"], default="random")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tq_cli.calibration.random_tokens import self_calibration_ids
    from tq_cli.evaluation.compare import causal_metrics
    from tq_cli.io.text import Text, evaluation_text
    from tq_cli.planning.prepare import plan_source

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.reference)
    ref = AutoModelForCausalLM.from_pretrained(args.reference, dtype=torch.float32).eval()
    cand = quantized_model(ref, args.checkpoint)
    ids = torch.tensor(tok(evaluation_text().text)["input_ids"][:4096])
    t0 = time.perf_counter()
    before = causal_metrics(ref, cand, ids, 512, None)
    print(f"before: KL {before['kl_mean']:.4f}", file=sys.stderr, flush=True)
    seqs = self_calibration_ids(plan_source(args.reference, None), args.tokens, 0, "cpu",
                                sampled=args.data == "sampled")[0]
    ids_sha = Text(" ".join(map(str, seqs.view(-1).tolist())), "ids").sha256
    rows = tune(ref, cand, seqs, args.steps, args.lr, args.batch)
    after = causal_metrics(ref, cand, ids, 512, None)
    result = {"checkpoint": str(args.checkpoint), "data": args.data, "ids_sha256": ids_sha,
              "steps": args.steps, "lr": args.lr, "batch": args.batch,
              "before": before, "after": after, "blocks": rows,
              "seconds": time.perf_counter() - t0}
    print(f"KL {before['kl_mean']:.4f} -> {after['kl_mean']:.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

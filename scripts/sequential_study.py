"""Which activations should GPTQ's Hessians come from: the original model's, or the
quantized model's own? A study on a Llama-like causal LM.

Usage (the project's venv):
    python scripts/sequential_study.py SOURCE [--bits 3] [--data sampled|random]
        [--tokens 8192] [--modes original,block,layer] [--json OUT.json]

`tq convert`'s self-calibration runs the original model block by block and takes every
converted layer's H = E[x x^T] from the original model's activations. GPTQ's reference
code (Frantar et al. 2022, arXiv:2210.17323, sec. 5 and its `llama_sequential`) instead
feeds each block the outputs of the blocks already quantized, and with its
"true-sequential" option takes each sublayer's inputs with the sublayers before it in
the block quantized too. Each mode here fits every converted layer with tq's own fit
(`tq_cli.quant.choose.fit_weight`: the conversion's column scales, rotation, grid, GPTQ
and scale refit, on the conversion's own calibration tokens, drawn by
`synthetic_run` as `tq convert --self-calib sampled|random` draws them):
- `original`: H from the original model (what `tq convert` does);
- `block`: each block's H from the outputs of the quantized blocks before it;
- `layer`: as `block`, and within a block q/k/v, o, gate/up and down in turn, each
  group's H with the groups before it quantized (GPTQ's true-sequential);
- `target`: as `layer`, with the original model's outputs as the target (asymmetric
  calibration, GPTAQ: Li et al. 2025, arXiv:2504.02692): minimising ||W X - W_hat X~||^2
  over the quantized model's inputs X~ is GPTQ with H~ = E[x~ x~^T] on the weight
  W' = W E[x x~^T] H~^-1 (the least-squares fit of the original outputs from X~; the
  rest of the objective does not depend on W_hat).
Then KL, perplexity and top-1 against SOURCE on tq's evaluation text (the first 4096
tokens, context 512, `tq eval`'s windows: `causal_metrics`). The head stays in float32
(as `--head-bits none`). Nothing is written but the JSON.
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
from torch import nn

# Sublayers of a Llama-like block in the order a forward pass reads them; each inner
# list reads one input.
STAGES = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
          ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


class Store:
    """tq's `Hessians` over H's collected here (the mean E[x x^T])."""

    def __init__(self) -> None:
        self.h: dict[str, torch.Tensor] = {}

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        h = self.h.get(tensor_name)
        return None if h is None else h.clone()

    def unusable(self, tensor_name: str) -> str | None:
        return None

    def group(self, tensor_name: str) -> str | None:
        return None


def _out(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple | list) else y


@torch.no_grad()
def collect(block: nn.Module, inputs: list[tuple[tuple, dict]],
            paths: list[str]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Mean x x^T at each sublayer in `paths` over the block run on `inputs` (the
    calibration's own accumulator, `InputGroup`), and the block's outputs."""
    from tq_cli.calibration.hessian import InputGroup

    groups = {p: InputGroup(p, {p: p}, block.get_submodule(p).in_features) for p in paths}

    def hook(path: str) -> Any:
        def pre(_m: nn.Module, args: tuple) -> None:
            groups[path].add(path, args[0])
        return pre

    handles = [block.get_submodule(p).register_forward_pre_hook(hook(p)) for p in paths]
    try:
        outs = [_out(block(*a, **k)) for a, k in inputs]
    finally:
        for h in handles:
            h.remove()
    means = {}
    for p, g in groups.items():
        assert g.h is not None
        means[p] = g.h / g.tokens
    return means, outs


@torch.no_grad()
def cross(fb: nn.Module, qb: nn.Module, fp_in: list[tuple[tuple, dict]],
          q_in: list[tuple[tuple, dict]], paths: list[str]) -> dict[str, tuple[torch.Tensor,
                                                                             torch.Tensor]]:
    """(E[x x~^T], E[x~ x~^T]) at each sublayer in `paths`: x from the original block on
    the original inputs, x~ from the quantized block on the quantized model's inputs."""
    held: dict[str, torch.Tensor] = {}
    sums: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}

    def keep(path: str) -> Any:
        def pre(_m: nn.Module, args: tuple) -> None:
            held[path] = args[0].reshape(-1, args[0].shape[-1]).float()
        return pre

    def pair(path: str) -> Any:
        def pre(_m: nn.Module, args: tuple) -> None:
            xq = args[0].reshape(-1, args[0].shape[-1]).float()
            x = held.pop(path)
            if path not in sums:
                sums[path] = [torch.zeros(x.shape[1], x.shape[1]) for _ in range(2)]
                counts[path] = 0
            counts[path] += x.shape[0]
            sums[path][0].addmm_(x.T, xq)
            sums[path][1].addmm_(xq.T, xq)
        return pre

    handles = [fb.get_submodule(p).register_forward_pre_hook(keep(p)) for p in paths]
    handles += [qb.get_submodule(p).register_forward_pre_hook(pair(p)) for p in paths]
    try:
        for (a, k), (aq, kq) in zip(fp_in, q_in, strict=True):
            fb(*a, **k)
            qb(*aq, **kq)
    finally:
        for h in handles:
            h.remove()
    return {p: (c / counts[p], h / counts[p]) for p, (c, h) in sums.items()}


def corrected(w: torch.Tensor, c: torch.Tensor, h: torch.Tensor,
              damp: float = 0.01) -> torch.Tensor:
    """W' = W C H~^-1, written W + W (C - H~) H~^-1 so that GPTQ's damping of H~ acts on
    the correction alone (damping W C H~^-1 itself would shrink W along every direction
    of small variance, where C = H~ at the start of the first block)."""
    hd = h.double() + damp * float(h.diagonal().mean()) * torch.eye(h.shape[0],
                                                                     dtype=torch.float64)
    delta = (w.double() @ (c.double() - h.double())).T
    return (w.double() + torch.linalg.solve(hd, delta).T).float()


@torch.no_grad()
def run(ref: nn.Module, planned: Any, seqs: torch.Tensor, mode: str,
        batch: int) -> nn.Module:
    """A copy of `ref` with every block's converted layers fitted under `mode`."""
    from tq_cli.calibration.skeleton import catch_block_inputs, with_hidden
    from tq_cli.quant.choose import CalibOptions, fit_weight
    from tq_cli.quant.grouped import dequantize
    from tq_cli.quant.rotation import make_rotation

    plans = {t.info.name: t for t in planned.plan.converted if not t.head}
    cand = copy.deepcopy(ref)
    fp_in = catch_block_inputs(ref, ref.model.layers[0], seqs, batch, torch.device("cpu"))
    q_in = list(fp_in)
    store = Store()
    calib = CalibOptions(store)  # type: ignore[arg-type]

    def fit(i: int, block: nn.Module, paths: list[str], hs: dict[str, torch.Tensor],
            cs: dict[str, torch.Tensor] | None = None) -> None:
        for p in paths:
            name = f"model.layers.{i}.{p}.weight"
            tp = plans[name]
            store.h = {name: hs[p]}
            mod = block.get_submodule(p)
            rot = make_rotation(tp.rotation, mod.weight.shape[1], tp.block)
            w = ref.get_submodule(f"model.layers.{i}.{p}").weight.detach().clone()
            if cs is not None:
                w = corrected(w, cs[p], hs[p])
            res = fit_weight(name, w, tp.quant, rot, torch.device("cpu"), calib, owned=True)
            assert res.fallback is None, res.fallback
            mod.weight.copy_(dequantize(res.q).to(mod.weight.dtype))

    for i, (fb, qb) in enumerate(zip(ref.model.layers, cand.model.layers, strict=True)):
        t0 = time.perf_counter()
        every = [p for stage in STAGES for p in stage]
        if mode == "original":
            hs, outs = collect(fb, fp_in, every)
            fit(i, qb, every, hs)
            fp_in = [with_hidden(a, k, y) for (a, k), y in zip(fp_in, outs, strict=True)]
            print(f"{mode}: block {i} {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            continue
        if mode == "block":
            hs, _ = collect(fb, q_in, every)
            fit(i, qb, every, hs)
        elif mode == "layer":  # each stage's H with the stages before it quantized
            for stage in STAGES:
                hs, _ = collect(qb, q_in, stage)
                fit(i, qb, stage, hs)
        else:  # target: as layer, towards the original outputs
            for stage in STAGES:
                pairs = cross(fb, qb, fp_in, q_in, stage)
                fit(i, qb, stage, {p: h for p, (_, h) in pairs.items()},
                    {p: c for p, (c, _) in pairs.items()})
            outs = [_out(fb(*a, **k)) for a, k in fp_in]
            fp_in = [with_hidden(a, k, y) for (a, k), y in zip(fp_in, outs, strict=True)]
        outs = [_out(qb(*a, **k)) for a, k in q_in]
        q_in = [with_hidden(a, k, y) for (a, k), y in zip(q_in, outs, strict=True)]
        print(f"{mode}: block {i} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return cand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--data", choices=["random", "sampled"], default="sampled")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--modes", default="original,block,layer")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tq_cli.calibration.random_tokens import self_calibration_ids
    from tq_cli.evaluation.compare import causal_metrics
    from tq_cli.io.text import evaluation_text
    from tq_cli.planning.prepare import plan_source
    from tq_cli.quant.spec import CONVERT_COL_SCALE, QuantSpec, RotationSpec

    torch.manual_seed(0)
    quant = QuantSpec(bits=args.bits, col_scale=CONVERT_COL_SCALE)
    planned = plan_source(args.source, None, quant, RotationSpec())
    t0 = time.perf_counter()
    seqs, record = self_calibration_ids(planned, args.tokens, 0, "cpu",
                                        sampled=args.data == "sampled")
    print(f"calibration ids {tuple(seqs.shape)} in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(args.source)
    ref = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    ids = torch.tensor(tok(evaluation_text().text)["input_ids"][:4096])
    result: dict[str, Any] = {"source": args.source, "bits": args.bits, "data": args.data,
                              "calibration": record, "modes": {}}
    for mode in args.modes.split(","):
        t1 = time.perf_counter()
        cand = run(ref, planned, seqs, mode, args.batch)
        fit_s = time.perf_counter() - t1
        metrics = causal_metrics(ref, cand, ids, 512, None)
        result["modes"][mode] = {"fit_seconds": fit_s, **metrics}
        print(f"{mode}: KL {metrics['kl_mean']:.4f} perplexity "
              f"{metrics['candidate_perplexity']:.2f} top-1 {metrics['top1_agreement']:.4f} "
              f"({fit_s:.0f} s)", flush=True)
        del cand
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

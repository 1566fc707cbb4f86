"""Which measured sensitivity predicts the end-to-end KL of a mixed-width model best.

Usage: python scripts/sensitivity_study.py SOURCE [--targets 2.5,3,3.5] [--bits 2,3,4]
           [--calib-tokens 4096] [--kl-tokens 1024] [--eval-tokens 4096] [--json FILE]

For a causal LM SOURCE (a float folder), with `tq convert`'s defaults (column scales,
Hadamard, group 128, the fit calibrated on --calib-tokens random tokens: the Hessians
`--target-bits` uses; the head is left in float32 here, for every row alike):
1. every converted tensor fitted at each of --bits as the conversion fits it
   (`prepare_weight`, `quantize_tensor`), kept dequantized;
2. what each (tensor, width) is predicted to cost the model, from:
   - `hessian`: tr(dW H dW^T), H = E[x x^T] on the calibration tokens (what `--target-bits`
     minimises today: HAWQ's proxy); `hessian-rel`: the same over tr(W H W^T);
   - `fisher`: 1/2 sum_i F_i (dW H dW^T)_ii, F_i = E[g_i^2] with g the gradient of the
     log-likelihood of the model's own sampled next tokens with respect to output i of
     the layer (the diagonal of the Fisher information of the layer's output), on the
     same random tokens: the second-order estimate of the KL that the error adds;
   - `kl-random`: the KL to the original with only that tensor quantized, measured on
     --kl-tokens random tokens (the calibration's distribution: no data);
   - `truth`: the same KL on the first --kl-tokens of the evaluation text (what the others
     predict; as an allocation it is an oracle, shown as a bound, not a method);
   the last two take a forward pass per tensor and width: with --kl-sample N only N
   tensors (drawn at random, every kind alike) are measured, for the agreement alone;
3. their agreement with `truth`: Spearman over all (tensor, width) pairs, and over the
   cost of each step down in width (what the allocator trades);
4. per predictor and --targets, `allocate` (the conversion's own knapsack over the same
   storage bits the manifest counts) chooses widths, and the model assembled from the
   kept fits is measured on --eval-tokens of the evaluation text as `tq eval` measures
   (`causal_metrics`, context 512), beside every uniform width.
Prints one JSON document (and writes it to --json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.calibration.random_tokens import random_token_ids, special_ids, synthetic_calibration
from tq_cli.conversion.mixed_precision import allocate, storage_bits
from tq_cli.conversion.spec import ConvertSpec
from tq_cli.evaluation.compare import causal_metrics, spearman
from tq_cli.io.calibration import read_calibration
from tq_cli.io.safetensors_reader import read_weight
from tq_cli.io.text import evaluation_text
from tq_cli.planning.prepare import plan_source
from tq_cli.quant.choose import CalibOptions, quantize_tensor
from tq_cli.quant.grouped import dequantize
from tq_cli.quant.prepare import prepare_weight
from tq_cli.quant.rotation import make_rotation

PREDICTORS = ("hessian", "hessian-rel", "fisher", "kl-random", "truth")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kl_of(model: nn.Module, ids: torch.Tensor, ref_logp: torch.Tensor) -> float:
    """Mean KL(ref || model) per token over rows of ids [b, t] (every position scored)."""
    with torch.no_grad():
        lp = model(ids).logits.float().log_softmax(-1)
    return float((ref_logp.exp() * (ref_logp - lp)).sum(-1).mean())


def ref_logp(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float().log_softmax(-1)


def fisher_diag(model: nn.Module, modules: dict[str, nn.Module], ids: torch.Tensor,
                seed: int) -> dict[str, torch.Tensor]:
    """E[g_i^2] per output of each module, g the gradient of log p(y) at sampled y ~ p."""
    acc = {n: torch.zeros(m.weight.shape[0], dtype=torch.float64) for n, m in modules.items()}
    count = [0]
    hooks = []
    for n, m in modules.items():
        def hook(_m: nn.Module, _gi: Any, go: tuple[torch.Tensor, ...], n: str = n) -> None:
            g = go[0].detach().double()
            acc[n] += g.pow(2).reshape(-1, g.shape[-1]).sum(0)
        hooks.append(m.register_full_backward_hook(hook))
    gen = torch.Generator().manual_seed(seed)
    for row in ids:
        model.zero_grad(set_to_none=True)
        logits = model(row[None]).logits.float()[0]
        with torch.no_grad():
            y = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        # a sum over tokens: each token's own gradient reaches the layer outputs unscaled
        nn.functional.cross_entropy(logits, y, reduction="sum").backward()
        count[0] += row.numel()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return {n: a / count[0] for n, a in acc.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--targets", default="2.5,3,3.5")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--kl-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--kl-sample", type=int, default=0, help="0: every tensor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    widths = [int(b) for b in args.bits.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    spec = ConvertSpec(synthetic_calib=args.calib_tokens)
    planned = plan_source(args.source, None, spec.quant, spec.rotation, check=True)
    plan = planned.plan
    todo = [t for t in plan.converted if not t.head]
    with tempfile.TemporaryDirectory(prefix="tq-study-") as tmp:
        path, record = synthetic_calibration(planned, args.calib_tokens, spec.rotation.seed,
                                             Path(tmp), "cpu")
        calibration = read_calibration(path)
        calib = CalibOptions(calibration, spec.damp, spec.act_order)
        log(f"calibration: {record.get('tokens')} random tokens")
        # 1. fits at every width, kept dequantized; the tensor's storage at each width
        fits: dict[str, dict[int, torch.Tensor]] = {}
        costs: dict[str, dict[str, dict[int, float]]] = {p: {} for p in PREDICTORS}
        sbits: dict[str, dict[int, int]] = {}
        hess: dict[str, torch.Tensor] = {}
        rotations: dict[str, Any] = {}
        for i, tp in enumerate(todo):
            assert tp.quant is not None and tp.rotation is not None
            name, (out, n) = tp.info.name, tp.info.shape
            w = read_weight(tp.info)
            if tp.rotation_id not in rotations:
                rotations[tp.rotation_id] = make_rotation(tp.rotation, n, tp.block)
            rot = rotations[tp.rotation_id]
            rp = plan.rotations[tp.rotation_id]
            share = sum(plan.layout.slots[k].nbytes for k, _, _ in rp.keys) * 8 / rp.users
            prepared = prepare_weight(w, tp.quant, rot)
            h = calibration.hessian(name)
            assert h is not None, name
            hess[name] = h
            fits[name], sbits[name] = {}, {}
            costs["hessian"][name], costs["hessian-rel"][name] = {}, {}
            for b in widths:
                q_spec = tp.quant.model_copy(update={"bits": b})
                res = quantize_tensor(name, prepared, q_spec, rot, torch.device("cpu"), calib)
                fits[name][b] = dequantize(res.q)
                sbits[name][b] = storage_bits(out, n, q_spec) + round(share)
                costs["hessian"][name][b] = float(res.weighted_error or 0.0)
                costs["hessian-rel"][name][b] = float(res.record["weighted_rel_error"])
            log(f"fitted {i + 1}/{len(todo)} {name}")
        calibration = None
    # 2. the model, its modules, the tokens
    model = AutoModelForCausalLM.from_pretrained(args.source, torch_dtype=torch.float32)
    model.eval()
    mods = {n: model.get_submodule(n.removesuffix(".weight")) for n in fits}
    originals = {n: m.weight.data.clone() for n, m in mods.items()}
    cfg = json.loads((args.source / "config.json").read_text())
    rand = torch.tensor(random_token_ids(cfg["vocab_size"], special_ids(cfg),
                                         args.calib_tokens, args.seed + 1)).view(-1, 512)
    tok = AutoTokenizer.from_pretrained(args.source)
    text_ids = tok(evaluation_text().text, return_tensors="pt").input_ids[0]
    kl_rows = args.kl_tokens // 512
    kl_sets = {"kl-random": rand[:kl_rows], "truth": text_ids[: kl_rows * 512].view(-1, 512)}
    log("fisher")
    for p in model.parameters():
        p.requires_grad_(False)
    for m in mods.values():
        m.weight.requires_grad_(True)  # so that the modules' backward hooks fire
    fisher = fisher_diag(model, mods, rand, args.seed)
    for m in mods.values():
        m.weight.requires_grad_(False)
    for name in fits:
        costs["fisher"][name] = {}
        for b in widths:
            dw = (originals[name] - fits[name][b]).double()
            rows = ((dw @ hess[name].double()) * dw).sum(-1)  # (dW H dW^T)_ii
            costs["fisher"][name][b] = 0.5 * float((fisher[name] * rows).sum())
    log("single-tensor KL")
    refs = {k: ref_logp(model, v) for k, v in kl_sets.items()}
    measured = list(fits)
    if 0 < args.kl_sample < len(measured):
        order = torch.randperm(len(measured), generator=torch.Generator().manual_seed(7))
        measured = sorted(measured[i] for i in order[: args.kl_sample].tolist())
    for j, name in enumerate(measured):
        for k in kl_sets:
            costs[k][name] = {}
        for b in widths:
            mods[name].weight.data.copy_(fits[name][b])
            for k, ids in kl_sets.items():
                costs[k][name][b] = kl_of(model, ids, refs[k])
        mods[name].weight.data.copy_(originals[name])
        if (j + 1) % 10 == 0:
            log(f"single-tensor KL {j + 1}/{len(measured)}")
    del refs
    # 3. agreement with the truth
    agree: dict[str, dict[str, float]] = {}
    truth = torch.tensor([costs["truth"][n][b] for n in measured for b in widths])
    steps_t = torch.tensor([costs["truth"][n][lo] - costs["truth"][n][hi] for n in measured
                            for lo, hi in itertools.pairwise(widths)])
    for p in PREDICTORS[:-1]:
        vals = torch.tensor([costs[p][n][b] for n in measured for b in widths])
        steps = torch.tensor([costs[p][n][lo] - costs[p][n][hi] for n in measured
                              for lo, hi in itertools.pairwise(widths)])
        agree[p] = {"spearman": spearman(vals, truth),
                    "spearman_steps": spearman(steps, steps_t)}
    log(f"agreement: {agree}")
    # 4. allocations, and every model measured on the evaluation text
    ref = AutoModelForCausalLM.from_pretrained(args.source, torch_dtype=torch.float32).eval()
    eval_ids = text_ids[: args.eval_tokens]
    numel = {n: fits[n][widths[0]].numel() for n in fits}

    def measure(choice: dict[str, int]) -> dict[str, Any]:
        for n, b in choice.items():
            mods[n].weight.data.copy_(fits[n][b])
        m = causal_metrics(ref, model, eval_ids, 512, None)
        used = sum(sbits[n][b] for n, b in choice.items())
        return {"bits_per_weight": used / sum(numel.values()), "kl": m["kl_mean"],
                "perplexity": m["candidate_perplexity"], "top1": m["top1_agreement"],
                "reference_perplexity": m["reference_perplexity"],
                "widths": {str(b): sum(1 for v in choice.values() if v == b) for b in widths}}

    rows: list[dict[str, Any]] = []
    for b in widths:
        rows.append({"method": f"uniform {b}", **measure(dict.fromkeys(fits, b))})
        log(f"uniform {b}: {rows[-1]['kl']:.4f}")
    whole = len(measured) == len(fits)
    for target in targets:
        for p in [p for p in PREDICTORS if whole or len(costs[p]) == len(fits)]:
            opts = {n: {b: (costs[p][n][b], sbits[n][b]) for b in widths} for n in fits}
            alloc = allocate(opts, target, numel)
            rows.append({"method": p, "target": target, **measure(alloc.bits),
                         "by_kind": _by_kind(alloc.bits)})
            log(f"{p} @ {target}: {rows[-1]['kl']:.4f}")
    doc = {"source": str(args.source), "calibration": record, "widths": widths,
           "kl_tokens": kl_rows * 512, "kl_tensors": len(measured),
           "eval_tokens": int(eval_ids.numel()),
           "agreement": agree, "rows": rows, "seconds": round(time.time() - t_start),
           "costs": {p: costs[p] for p in PREDICTORS}}
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "costs"}, indent=1))
    return 0


def _by_kind(choice: dict[str, int]) -> dict[str, float]:
    """Mean width per projection kind (q_proj, down_proj, ...), to see where bits went."""
    kinds: dict[str, list[int]] = {}
    for n, b in choice.items():
        kinds.setdefault(n.split(".")[-2], []).append(b)
    return {k: sum(v) / len(v) for k, v in sorted(kinds.items())}


if __name__ == "__main__":
    sys.exit(main())

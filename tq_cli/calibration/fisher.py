"""The diagonal of the Fisher information at each converted layer's output, one block at a
time: what a weight error there costs the model's predictions (for an encoder, whose
output is its hidden states, what it costs them: `_probe_gradients`).

For a layer z = W x, an error dW moves z by dW x, and to second order the KL divergence
from the model's next-token distribution grows by 1/2 dz^T F dz, F = E[g g^T] with g the
gradient of log p(y) with respect to z at y drawn from the model itself (the Fisher
information of the output). Keeping F's diagonal and taking x independent of g (K-FAC's
factorisation, Martens & Grosse 2015, arXiv:1503.05671) gives
1/2 sum_i F_i (dW H dW^T)_ii with H = E[x x^T], the statistic GPTQ already uses: the
cost `--target-bits` ranks every (tensor, width) by (tq_cli.conversion.mixed_precision).
Measured against the plain tr(dW H dW^T) in docs/results.md.

The run keeps one block in memory, as calibration does (tq_cli.calibration.run): every
block runs forward on the calibration tokens with its input saved to disk; the head
(final norm, output embedding) turns the last output into logits, a token is drawn per
position (seeded) and the gradient of its log-likelihood taken; then the blocks run
again in reverse, each from its saved input, with the gradient of its output fed in and
the squared gradients summed at its converted layers' outputs, as activation
checkpointing would. About three forward passes in all. Pure but for `folder`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.calibration.run import CalibRun
from tq_cli.calibration.skeleton import BlockWeights, hidden_of, with_hidden
from tq_cli.errors import UnsupportedError

CHUNK_LOGITS = 1 << 25  # logits formed at once (128 MB of float32) at the head


@dataclass(frozen=True)
class OutputFisher:
    """F_i per converted tensor (float64 [out]: the sum of g_i^2 over the run's tokens
    over their count), the tokens it was measured on, and the tensors it could not
    reach with why (experts stored fused, layers outside the blocks)."""

    fisher: dict[str, torch.Tensor]
    tokens: int
    missing: dict[str, str]


def _path_of(run: CalibRun, module: nn.Module) -> str:
    return next(n for n, m in run.modules.items() if m is module)


def _load_head(run: CalibRun,
               weights: BlockWeights) -> tuple[nn.Module, nn.Linear, nn.Module | None]:
    """The final norm and the output embedding, their weights read (a tied head reads the
    input embedding's, which is returned too, to be released with them)."""
    model: Any = run.model
    norm = run.layers.tail_norm
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if norm is None or not isinstance(head, nn.Linear):
        raise UnsupportedError(f"{type(model).__name__}: no final norm and linear output "
                               "head after the blocks")
    weights.load(norm, _path_of(run, norm))
    path = _path_of(run, head)
    if weights.has(f"{path}.weight"):  # transformers' renames included
        weights.load(head, path)
        return norm, head, None
    emb = model.get_input_embeddings()  # tied to the input embedding
    weights.load(emb, _path_of(run, emb))
    head._parameters["weight"] = emb.weight
    if head.bias is not None:
        weights.load(head, path)
    return norm, head, emb


def _logits(run: CalibRun, head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    logits = head(x).float()
    model: Any = run.model
    cfg = model.config.get_text_config()
    scale = getattr(cfg, "logit_scale", None)
    if isinstance(scale, int | float) and scale != 1:
        logits = logits * scale
    divide = getattr(cfg, "logits_scaling", None)  # Granite divides its logits
    if isinstance(divide, int | float) and divide not in (0, 1):
        logits = logits / divide
    cap = getattr(cfg, "final_logit_softcapping", None)
    if isinstance(cap, int | float) and cap > 0:
        logits = torch.tanh(logits / cap) * cap
    return logits


def output_fisher(run: CalibRun, folder: Path, seed: int) -> OutputFisher:
    """F_i at the output of every converted layer inside the blocks (module `run.layers`),
    on the run's token sequences. `folder`: scratch space for one block input per block
    (the calibration tokens' hidden states: 64 MB a block at 4096 tokens of width 4096),
    emptied again whether or not the run succeeds."""
    inputs = run.catch()
    run.inputs = None
    weights = BlockWeights(run.source, run.prefix, run.device, run.sources)
    folder.mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    try:
        with torch.no_grad():
            for i, block in enumerate(run.blocks):
                path = folder / f"block{i:05d}.pt"
                torch.save([hidden_of(a, k).cpu() for a, k in inputs], path)
                saved.append(path)
                weights.load(block, f"{run.bpath}.{i}")
                for j, (args, kwargs) in enumerate(inputs):
                    y = block(*args, **kwargs)
                    y = y[0] if isinstance(y, tuple | list) else y
                    inputs[j] = with_hidden(args, kwargs, y)
                weights.release(block)
        model: Any = run.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
            else None
        if head is None and not (hasattr(model, "can_generate") and model.can_generate()):
            grads, tokens = _probe_gradients(inputs, seed)  # an encoder: its hidden states
        else:
            grads, tokens = _head_gradients(run, weights, inputs, seed)
        missing = {n: "a MoE expert stored fused: no layer output to measure" for t in
                   run.layers.taps for grp in t.groups.values() for n in grp.members.values()}
        for grp in run.layers.tail:
            missing.update((n, "outside the blocks") for n in grp.members.values())
        sums = _walk_back(run, weights, inputs, grads, saved, missing)
    finally:  # a failed run leaves no block inputs behind
        for path in saved:
            path.unlink(missing_ok=True)
    fisher = {n: s / tokens for n, s in sums.items()}
    bad = [n for n, f in fisher.items() if not bool(torch.isfinite(f).all())]
    if bad:
        raise UnsupportedError(f"the Fisher information of '{bad[0]}' is not finite: the "
                               "model overflows on the calibration tokens")
    return OutputFisher(fisher, tokens, missing)


def _head_gradients(run: CalibRun, weights: BlockWeights, inputs: list[tuple[tuple, dict]],
                    seed: int) -> tuple[list[torch.Tensor], int]:
    """The gradient of log p(y) at the last block's output per batch, y drawn from the
    model at every position (seeded), and the number of tokens."""
    norm, head, emb = _load_head(run, weights)
    gen = torch.Generator().manual_seed(seed)
    grads: list[torch.Tensor] = []
    tokens = 0
    rows = max(1, CHUNK_LOGITS // max(1, head.out_features))
    for args, kwargs in inputs:
        h = hidden_of(args, kwargs)
        flat = h.reshape(-1, h.shape[-1])
        g = torch.empty_like(flat)
        for r in range(0, flat.shape[0], rows):
            x = flat[r:r + rows].detach().requires_grad_(True)
            with torch.enable_grad():
                logits = _logits(run, head, norm(x))
                with torch.no_grad():
                    p = logits.softmax(-1).cpu()
                    drawn = torch.multinomial(p, 1, generator=gen)[:, 0]
                loss = nn.functional.cross_entropy(logits, drawn.to(logits.device),
                                                   reduction="sum")
                (g[r:r + rows],) = torch.autograd.grad(loss, x)
        grads.append(g.view_as(h))
        tokens += flat.shape[0]
    for m in (norm, head, emb):
        if m is not None:
            weights.release(m)
    return grads, tokens


def _probe_gradients(inputs: list[tuple[tuple, dict]],
                     seed: int) -> tuple[list[torch.Tensor], int]:
    """For a model whose output is its last hidden states (an encoder: embeddings), the
    gradients of <v, y> with v ~ N(0, I) per position: E[g g^T] = J J^T, the Fisher
    information of a Gaussian of unit variance around the output, whose KL is half the
    squared error of the hidden states."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for args, kwargs in inputs:
        h = hidden_of(args, kwargs)
        grads.append(torch.randn(h.shape, generator=gen, dtype=h.dtype).to(h.device))
    return grads, sum(int(g[..., 0].numel()) for g in grads)


def _walk_back(run: CalibRun, weights: BlockWeights, inputs: list[tuple[tuple, dict]],
               grads: list[torch.Tensor], saved: list[Path],
               missing: dict[str, str]) -> dict[str, torch.Tensor]:
    """The blocks in reverse, each from its saved input with its output's gradient fed in:
    the sums of g^2 at every converted layer's output (those in `missing` excepted)."""
    sums: dict[str, torch.Tensor] = {}
    for i in range(len(run.blocks) - 1, -1, -1):
        block = run.blocks[i]
        weights.load(block, f"{run.bpath}.{i}")
        handles = []
        for grp in run.layers.blocks[i]:
            for mpath, name in grp.members.items():
                if name in missing:
                    continue
                mod: Any = run.modules[mpath]
                acc = sums.setdefault(name, torch.zeros(int(mod.weight.shape[0]),
                                                        dtype=torch.float64))
                handles.append(mod.register_forward_hook(_summing(acc)))
        hidden = torch.load(saved[i], weights_only=True)
        try:
            for j, (args, kwargs) in enumerate(inputs):
                x = hidden[j].to(run.device).requires_grad_(True)
                a, k = with_hidden(args, kwargs, x)
                with torch.enable_grad():
                    y = block(*a, **k)
                    y = y[0] if isinstance(y, tuple | list) else y
                    torch.autograd.backward(y, grads[j])
                if x.grad is None:
                    raise UnsupportedError(f"block {i} does not pass gradients back to its "
                                           "input")
                grads[j] = x.grad
        finally:
            for hd in handles:
                hd.remove()
        weights.release(block)
        saved[i].unlink()
    return sums


def _summing(acc: torch.Tensor):  # type: ignore[no-untyped-def]
    """A forward hook that adds the squared gradient of the module's output to `acc`."""

    def hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def add(g: torch.Tensor) -> None:
                acc.add_(g.detach().reshape(-1, g.shape[-1]).pow(2).sum(0, dtype=torch.float64)
                         .cpu())
            out.register_hook(add)

    return hook


def fisher_cost(fisher: torch.Tensor, row_errors: torch.Tensor) -> float:
    """1/2 sum_i F_i (dW H dW^T)_ii: the second-order KL a fit's row errors add."""
    value = 0.5 * float((fisher.double() * row_errors.double().to(fisher.device)).sum())
    return value if math.isfinite(value) else math.inf

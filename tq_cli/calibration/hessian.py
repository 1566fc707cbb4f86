"""Accumulating H = E[x x^T] per converted layer input during `tq calibrate`.

Each converted linear layer's input feeds a float32 accumulator (per-batch x^T x added
by the GEMM itself) through a forward pre-hook; layers that read the same input
(the recipe's `input_groups`: q/k/v, gate/up) share one `InputGroup`. `place_layers`
maps tensor names to modules and sorts the groups by block; a head that reads the
final norm of the last block (lm_head) is the tail. A MoE layer's experts, fused in the
model, are tapped at the experts module: each expert's Hessians come from the tokens
routed to it (`ExpertTap`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tq_cli.calibration.skeleton import candidates
from tq_cli.errors import UnsupportedError
from tq_cli.io.format import Expert
from tq_cli.planning.recipe import Recipe


class InputGroup:
    """One H = sum x x^T, shared by the modules that read the same input."""

    def __init__(self, key: str, members: dict[str, str], n: int) -> None:
        self.key, self.members, self.n = key, members, n  # members: module path -> tensor
        self.h: torch.Tensor | None = None
        self.tokens = 0
        self.seen = dict.fromkeys(members, 0)
        self.last: torch.Tensor | None = None

    def add(self, member: str, x: torch.Tensor) -> None:
        rows = x.numel() // self.n
        self.seen[member] += rows
        last = self.last
        if last is not None and (last is x or (last.shape == x.shape and torch.equal(last, x))):
            return  # a sibling already counted this very input
        self.last = x
        x2 = x.detach().reshape(rows, self.n).float()
        if self.h is None:
            self.h = torch.zeros(self.n, self.n, dtype=torch.float32, device=x.device)
        # Accumulated in float32 by the GEMM itself (addmm_: no product matrix beside H).
        # A float64 sum of float32 products, as before, held a 1.6 GB H and two more n x n
        # for a 14336-wide input, for no gain: a few dozen batches add a few float32 ulps,
        # far below the sampling noise of 10^3-10^5 tokens, and H is stored in float32.
        self.h.addmm_(x2.T, x2)
        self.tokens += rows

    def check(self, recipe: Recipe) -> None:
        if any(v != self.tokens for v in self.seen.values()):
            raise UnsupportedError(
                f"recipe '{recipe.name}': input_groups puts {', '.join(self.members)} together, "
                f"but they read different inputs ({self.seen}); fix input_groups")


def group_key(module: str, converted: set[str], recipe: Recipe) -> tuple[str, list[str]]:
    parent, _, leaf = module.rpartition(".")
    for grp in recipe.input_groups:
        if leaf in grp:
            sibs = [m for m in grp if (f"{parent}.{m}" if parent else m) in converted]
            return (f"{parent}.{'+'.join(sibs)}" if parent else "+".join(sibs)), sibs
    return module, [leaf]


@dataclass
class PlacedLayers:
    """Converted tensors placed in the model: groups per block, the tail, the rest."""

    blocks: list[list[InputGroup]]
    tail: list[InputGroup]
    tail_norm: nn.Module | None
    uncalibrated: dict[str, str]  # tensor -> reason
    taps: list[ExpertTap] = field(default_factory=list)  # the MoE layers' routed inputs

    def all(self) -> list[InputGroup]:
        return [g for gs in self.blocks for g in gs] + self.tail


class ExpertTap:
    """The inputs of one MoE layer's experts: each expert's gate and up projections read
    the tokens the router sent it, its down projection act(gate(x)) * up(x) of those
    tokens, computed from the layer's own (fused, full-precision) weights."""

    def __init__(self, of: str, groups: dict[tuple[int, str], InputGroup]) -> None:
        self.of = of
        self.groups = groups  # (expert, "in" | "down") -> group

    def hook(self, module: nn.Module) -> Any:
        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            named = ("hidden_states", "top_k_index", "top_k_weights")
            hidden, index = (*args, *(kwargs.get(k) for k in named[len(args):]))[:2]
            self.add(mod, hidden, index)
        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def add(self, mod: Any, hidden: torch.Tensor, index: torch.Tensor) -> None:
        from tq_cli.runtime.experts import routed

        hidden = hidden.reshape(-1, hidden.shape[-1])
        count = int(mod.gate_up_proj.shape[0])
        for e, rows, _ in routed(index, count):
            if (e, "in") not in self.groups:
                continue
            x = hidden[rows]
            gate, up = F.linear(x, mod.gate_up_proj[e].to(x.dtype)).chunk(2, dim=-1)
            for kind, inp in (("in", x), ("down", mod.act_fn(gate) * up)):
                g = self.groups[(e, kind)]
                g.last = None
                for member in g.members:
                    g.add(member, inp)


def _expert_taps(experts: Mapping[str, Expert], modules: dict[str, nn.Module], bpath: str,
                 out: PlacedLayers) -> list[ExpertTap]:
    layers: dict[str, dict[tuple[int, str], dict[str, str]]] = {}
    for name, ex in experts.items():
        kind = "down" if ex.role == "down" else "in"
        layers.setdefault(ex.of, {}).setdefault((ex.index, kind), {})[
            f"{ex.of}.{ex.index}.{ex.role}"] = name
    taps = []
    for of, members in layers.items():
        owner: Any = modules[of]
        hidden, inter = int(owner.down_proj.shape[1]), int(owner.down_proj.shape[2])
        groups = {key: InputGroup(f"{of}.{key[0]}.{'+'.join(m.rpartition('.')[2] for m in ms)}",
                                  ms, inter if key[1] == "down" else hidden)
                  for key, ms in sorted(members.items())}
        if not of.startswith(bpath + "."):
            for ms in members.values():
                for name in ms.values():
                    out.uncalibrated[name] = "an expert outside the blocks"
            continue
        out.blocks[int(of[len(bpath) + 1:].split(".")[0])].extend(groups.values())
        taps.append(ExpertTap(of, groups))
    return taps


def place_layers(model: nn.Module, names: list[str], recipe: Recipe, prefix: str,
                 bpath: str, n_blocks: int,
                 experts: Mapping[str, Expert] | None = None,
                 renamed: Mapping[str, str] | None = None) -> PlacedLayers:
    """Map converted tensor names to modules and group them by block and shared input;
    `experts` (tq_cli.runtime.module_map) are the tensors that are one expert's projection
    of a MoE layer: their inputs are the tokens routed to that expert (`ExpertTap`);
    `renamed` the module each other tensor runs as where transformers renames it."""
    modules = dict(model.named_modules())
    found: dict[str, str] = {}  # module path -> tensor name
    out = PlacedLayers([[] for _ in range(n_blocks)], [], None, {})
    out.taps = _expert_taps(experts or {}, modules, bpath, out)
    for name in names:
        if name in (experts or {}):
            continue
        base = name.removesuffix(".weight")
        path = next((c for c in [*candidates(base, prefix), (renamed or {}).get(name, "")]
                     if c in modules), None)
        if not name.endswith(".weight") or path is None:
            out.uncalibrated[name] = "no module of that name in the model"
        elif not isinstance(modules[path], nn.Linear):
            out.uncalibrated[name] = f"{type(modules[path]).__name__} is not nn.Linear"
        else:
            found[path] = name
    parent_path = bpath.rpartition(".")[0]
    parent = modules[parent_path] if parent_path else model
    kids = list(parent.named_children())
    after = [m for n, m in kids[[n for n, _ in kids].index(bpath.rpartition(".")[2]) + 1:]
             if any(True for _ in m.parameters())]
    if len(after) == 1 and "norm" in type(after[0]).__name__.lower():
        out.tail_norm = after[0]
    groups: dict[str, InputGroup] = {}
    for path in found:
        key, sibs = group_key(path, set(found), recipe)
        if key in groups:
            continue
        parent_of = path.rpartition(".")[0]
        members = {m: found[m] for m in (f"{parent_of}.{s}" if parent_of else s for s in sibs)}
        widths = {int(modules[m].in_features) for m in members}
        if len(widths) != 1:
            raise UnsupportedError(f"recipe '{recipe.name}': input_groups puts {list(members)} "
                                   "together but their input widths differ; fix input_groups")
        g = groups[key] = InputGroup(key, members, widths.pop())
        if path.startswith(bpath + "."):
            out.blocks[int(path[len(bpath) + 1:].split(".")[0])].append(g)
        elif "." in path:  # inside the base model, or deep in a head: inputs unknown
            for m in members.values():
                out.uncalibrated[m] = "outside the blocks and not a head on the final norm"
        elif out.tail_norm is None:
            for m in members.values():
                out.uncalibrated[m] = "no final norm after the blocks was recognised"
        else:  # a head such as lm_head reads norm(last block's output)
            out.tail.append(g)
    return out


def add_hooks(groups: list[InputGroup], modules: dict[str, nn.Module],
              taps: Sequence[ExpertTap] = ()) -> list[Any]:
    handles = [t.hook(modules[t.of]) for t in taps]
    tapped = {id(g) for t in taps for g in t.groups.values()}
    for g in groups:
        if id(g) in tapped:
            continue
        for path in g.members:
            def pre(_mod: nn.Module, args: tuple, g: InputGroup = g, path: str = path) -> None:
                g.add(path, args[0])
            handles.append(modules[path].register_forward_pre_hook(pre))
    return handles

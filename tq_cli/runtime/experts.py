"""TQExperts: a mixture-of-experts layer whose experts run from packed TurboQuant codes.

transformers 5 builds the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3 and their kin as one module holding two 3-D parameters, `gate_up_proj`
[experts, 2 x intermediate, hidden] and `down_proj` [experts, hidden, intermediate], and a
forward(hidden_states, top_k_index, top_k_weights) that runs, for every expert a token
was routed to, down(act(gate(x)) * up(x)) weighted by the router. Checkpoints store the
experts one by one (`experts.3.w1.weight`, `experts.3.gate_proj.weight`), and tq
converts them one by one, so each expert's gate, up and down projection is its own
TQLinear (experts that read the same input share one rotation, as every
tensor of the same input size and seed does). TQExperts replaces the family's experts
module and computes the same routed MLP through those layers, expert by expert, only
for the experts some token was routed to: no expert is ever dequantized to run it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tq_cli.runtime.tq_linear import TQLinear

# Flags transformers' `use_experts_implementation` sets on an experts module, with the
# value of the one layout TQExperts computes (concatenated [gate; up], no bias, ...).
LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False,
          "is_concatenated": True, "has_post_expert_norm": False}


def routed(top_k_index: torch.Tensor, num_experts: int
           ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, token rows, flat slots) for every expert some token was routed to: the
    routed slots sorted by expert once, so each expert runs once on all its tokens.
    Indices of `num_experts` or more (transformers' marker of a masked slot) are skipped;
    a token that picks an expert twice appears twice. `flat slot` indexes the router
    weights reshaped to one dimension."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for index, count in enumerate(counts):
        picked = order[start:start + count]
        start += count
        if count and index < num_experts:
            yield index, picked // k, picked


def unsupported_because(module: nn.Module) -> str | None:
    """Why TQExperts cannot stand in for `module`, or None when it can."""
    name = type(module).__name__
    params = {n: p for n, p in module.named_parameters(recurse=False)}
    if set(params) != {"gate_up_proj", "down_proj"} or any(p.dim() != 3 for p in params.values()):
        return (f"{name} holds its experts as other parameters than 3-D gate_up_proj and "
                "down_proj")
    if not all(hasattr(module, flag) for flag in LAYOUT) or not hasattr(module, "act_fn"):
        return f"{name} does not declare its experts' layout (transformers' experts flags)"
    off = [flag for flag, want in LAYOUT.items() if getattr(module, flag) != want]
    if off:
        return (f"{name}'s experts have a layout tq does not run quantized ({', '.join(off)} "
                "differ from the plain gate/up/down MLP)")
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return f"{name}: this transformers has no experts gating tq can check"
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return (f"{name} gates its experts its own way (not act(gate) * up), which tq does "
                "not run quantized")
    return None


class TQExperts(nn.Module):
    """The routed experts of one MoE layer, each projection a TQLinear.

    `layers` maps (expert, role) to the layer's path inside this module (`3.w1`, the
    checkpoint's own names, so that state-dict keys are the stored keys) and the layer.
    """

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, original: Any,
                 layers: dict[tuple[int, str], tuple[str, TQLinear]]) -> None:
        super().__init__()
        self.num_experts = int(original.gate_up_proj.shape[0])
        self.act_fn = original.act_fn
        # The family's own module, on meta: the shape dequantize() rebuilds. Kept out of
        # _modules so its parameters are not part of this module's state.
        self.__dict__["original"] = original
        table: list[dict[str, TQLinear]] = [{} for _ in range(self.num_experts)]
        for (index, role), (path, layer) in layers.items():
            if not 0 <= index < self.num_experts:
                raise ValueError(f"the manifest names expert {index}, but the layer has "
                                 f"{self.num_experts}")
            if layer.col_scale is not None:
                raise ValueError(f"expert {index}'s {role} projection stores column scales, "
                                 "which experts sharing one routed input cannot have")
            parent: nn.Module = self
            *parents, leaf = path.split(".")
            for part in parents:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                child = parent._modules[part]
                assert child is not None
                parent = child
            parent.add_module(leaf, layer)
            table[index][role] = layer
        missing = [i for i, roles in enumerate(table) if set(roles) != {"gate", "up", "down"}]
        if missing:
            raise ValueError(f"experts {missing[:5]} lack a gate, up or down projection")
        self.__dict__["table"] = table

    def expert(self, index: int) -> dict[str, TQLinear]:
        """Expert `index`'s layers by role ("gate", "up", "down")."""
        return self.__dict__["table"][index]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        weights = top_k_weights.reshape(-1)
        for index, rows, picked in routed(top_k_index, self.num_experts):
            layers = self.expert(index)
            x = hidden_states[rows]
            h = self.act_fn(layers["gate"](x)) * layers["up"](x)
            y = layers["down"](h) * weights[picked, None].to(h.dtype)
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def dequantize(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The family's own experts module with every expert's weights dequantized."""
        original = self.__dict__["original"]
        dt = dtype or torch.float32
        gate_up = torch.stack([torch.cat([self.expert(i)["gate"].dequantize(),
                                          self.expert(i)["up"].dequantize()])
                               for i in range(self.num_experts)]).to(dt)
        down = torch.stack([self.expert(i)["down"].dequantize()
                            for i in range(self.num_experts)]).to(dt)
        original.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        original.down_proj = nn.Parameter(down, requires_grad=False)
        return original

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}"

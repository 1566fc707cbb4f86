"""vLLM's side of a MoE layer whose experts tq converted: `TQMoEMethod`.

Written against vLLM 0.32's fused-MoE layer (vllm/model_executor/layers/fused_moe/):
`get_quant_method` is asked for each `RoutedExperts` (prefix `...experts`), whose
`create_weights` gets the local expert count and `intermediate_size_per_partition`
(tensor parallelism splits every expert's intermediate dimension; the runner all-reduces
what `apply` returns). `RoutedExperts.load_weights` renames a checkpoint key
`...experts.3.w1.tq_codes` (after tq's mapper: `X.weight.codes` -> `X.tq_codes`) to its
parameter `w13_tq_codes` and calls that parameter's weight loader with the expert id and
the shard id ("w1" gate, "w3" up, "w2" down). The parameters here are empty placeholders:
each loader cuts the stored tensor to the rank's share (gate and up: its rows of the
intermediate dimension; down: those columns, in whole groups and rotation blocks;
`tq_cli.vllm_plugin.split`) and keeps it per expert and projection.

`apply` receives the router's top-k (weights already normalised) and is one registered
custom op, `torch.ops.vllm.tq_moe`, because the per-expert token gather has
data-dependent sizes that torch.compile cannot trace. It rotates the tokens once for
every expert's gate and up (they share one rotation: the same input width and seed),
runs each routed expert's projections through tq's kernels (`tq_kernels.dispatch`:
native CPU, Triton on CUDA), and returns the rank's weighted partial sum.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

import tq_cli.vllm_plugin.split as split
from tq_cli.errors import UnsupportedError
from tq_cli.io.format import SUFFIXES
from tq_cli.runtime.experts import routed
from tq_cli.vllm_plugin.info import LayerInfo, rank_rotation
from tq_kernels import dispatch
from tq_kernels.reference import Material

SHARDS = {"w1": "gate", "w3": "up", "w2": "down"}  # vLLM's shard ids of an expert
# Placeholder parameters, one per stored suffix of the two fused weights vLLM names.
PARAMS = [f"{w}_tq_{s}" for w in ("w13", "w2") for s in SUFFIXES]

_LAYERS: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


@dataclass
class Projection:
    """One expert's gate, up or down projection on this rank."""

    info: LayerInfo
    rows: tuple[int, int]
    cols: tuple[int, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # suffix -> tensor


@dataclass
class MoEState:
    prefix: str
    experts: list[dict[str, Projection]]  # local expert -> role -> projection
    key: str = ""
    rotations: dict[str, tuple[Material, int]] = field(default_factory=dict)  # role -> ...


def _roles(config: Any, prefix: str, count: int) -> list[dict[str, LayerInfo]]:
    """Per expert, its converted gate, up and down, from the manifest's expert records."""
    found: list[dict[str, LayerInfo]] = [{} for _ in range(count)]
    for name, info in config.tensors.items():
        if name.startswith(prefix + ".") and info.expert is not None:
            index, role = info.expert
            if index < count:
                found[index][role] = info
    scaled = [i for i, roles in enumerate(found) if any(r.col_scale for r in roles.values())]
    if scaled:
        raise UnsupportedError(f"tq: {prefix}: expert {scaled[0]} stores column scales, which "
                               "experts sharing one routed input cannot have; reconvert it")
    missing = [i for i, roles in enumerate(found) if set(roles) != set(SHARDS.values())]
    if missing:
        raise UnsupportedError(f"tq: {prefix}: experts {missing[:5]} have no converted gate, "
                               "up or down projection in the manifest; convert all of a "
                               "layer's experts or none")
    return found


class TQMoEMethod(FusedMoEMethodBase):
    """The routed experts of one MoE layer, each projection from its own tq codes."""

    def __init__(self, config: Any, prefix: str, moe: Any) -> None:
        # config: the plugin's TQConfig (not imported: it imports this module)
        super().__init__(moe)
        self.config, self.prefix = config, prefix

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        moe = self.moe
        if moe.num_local_experts != moe.num_experts:
            raise UnsupportedError(f"tq: {self.prefix}: expert parallelism is not supported "
                                   "for converted experts; serve without "
                                   "--enable-expert-parallel")
        activation = getattr(getattr(layer, "activation", None), "value", "silu")
        if activation != "silu" or getattr(layer, "apply_router_weight_on_input", False):
            raise UnsupportedError(f"tq: {self.prefix}: experts with activation "
                                   f"'{activation}' (or router weights on the input) are not "
                                   "supported quantized; keep them with a recipe rule")
        tp_rank, tp_size = int(moe.tp_rank), int(moe.tp_size)
        local = intermediate_size_per_partition
        experts = []
        for roles in _roles(self.config, self.prefix, num_experts):
            down = roles["down"]
            inter = down.in_features
            if local * tp_size != inter or roles["gate"].in_features != hidden_size:
                raise UnsupportedError(
                    f"tq: {self.prefix}: vLLM builds experts of {hidden_size} x {local} per "
                    f"rank, the checkpoint's are {hidden_size} x {inter}; the checkpoint does "
                    "not match the model config")
            block = down.block if down.rotation else None
            if tp_size > 1 and not split.row_split_ok(inter, tp_size, down.group_size, block):
                raise UnsupportedError(split.split_refusal(
                    f"{self.prefix}.down", inter, tp_size, down.group_size, block))
            share = (tp_rank * local, (tp_rank + 1) * local)
            experts.append({
                "gate": Projection(roles["gate"], share, (0, hidden_size)),
                "up": Projection(roles["up"], share, (0, hidden_size)),
                "down": Projection(down, (0, hidden_size), share),
            })
        layer.__dict__["tq_moe"] = MoEState(self.prefix, experts)
        for name in PARAMS:
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": functools.partial(
                _load, layer, name.rpartition("_tq_")[2])})

    def get_fused_moe_quant_config(self, layer: nn.Module) -> Any:
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        st: MoEState = layer.__dict__["tq_moe"]
        dev = layer.get_parameter(PARAMS[0]).device
        for e, roles in enumerate(st.experts):
            for role, p in roles.items():
                absent = [s for s in SUFFIXES if s not in p.tensors]
                if absent:
                    raise UnsupportedError(f"tq: {st.prefix}: expert {e}'s {role} projection "
                                           f"lacks {', '.join(absent)} in the checkpoint")
                idx, val = split.slice_outliers(p.tensors["outlier_idx"], p.tensors["outlier_val"],
                                                p.info.in_features, p.rows, p.cols)
                p.tensors |= {"outlier_idx": idx, "outlier_val": val}
                p.tensors = {k: t.to(dev) for k, t in p.tensors.items()}
        for role in ("gate", "down"):
            p = st.experts[0][role]
            rid = p.info.rotation
            if rid is None:
                continue
            assert self.config.folder is not None
            st.rotations[role] = rank_rotation(self.config.folder, rid,
                                               self.config.rotations[rid], p.cols, dev)
        if any(r[role].info.rotation != st.experts[0][role].info.rotation
               for r in st.experts for role in ("gate", "up", "down")) or (
                st.experts[0]["gate"].info.rotation != st.experts[0]["up"].info.rotation):
            raise UnsupportedError(f"tq: {st.prefix}: the experts were converted with different "
                                   "rotations; convert them with one seed")
        st.key = f"{st.prefix}#{id(layer)}"
        _LAYERS[st.key] = layer

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts: Any = None,
              shared_experts_input: Any = None) -> torch.Tensor:
        st: MoEState = layer.__dict__["tq_moe"]
        y: torch.Tensor = torch.ops.vllm.tq_moe(x, topk_weights, topk_ids, st.key)
        return y


def _load(layer: nn.Module, suffix: str, param: nn.Parameter | None = None,
          loaded_weight: torch.Tensor | None = None, weight_name: str = "",
          shard_id: str | None = None, expert_id: int | None = None,
          return_success: bool = False, **_: Any) -> bool:
    """Weight loader of the placeholders: keep the rank's share of one expert's tensor."""
    st: MoEState = layer.__dict__["tq_moe"]
    local = layer._map_global_expert_id_to_local_expert_id(expert_id)  # type: ignore[operator]
    if local == -1 or loaded_weight is None:
        return False
    role = SHARDS.get(str(shard_id))
    if role is None:
        raise UnsupportedError(f"tq: {st.prefix}: a checkpoint tensor arrived for shard "
                               f"{shard_id!r} of expert {expert_id} ({weight_name}); tq "
                               "expects each expert's gate, up and down stored apart")
    p = st.experts[local][role]
    t = loaded_weight.detach().to("cpu")
    if suffix == "codes":
        t = split.slice_codes(t, p.info.bits, p.info.in_features, p.rows, p.cols)
    elif suffix == "scales":
        t = split.slice_scales(t, p.info.group_size, p.rows, p.cols)
    p.tensors[suffix] = t.clone()
    return True


def _linear(x: torch.Tensor, p: Projection, rotation: tuple[Material, int] | None
            ) -> torch.Tensor:
    t = p.tensors
    material, block = rotation if rotation is not None else (None, 0)
    return dispatch.linear(x, material, block, t["codes"], t["scales"], t["codebook"],
                           t["outlier_idx"], t["outlier_val"], None, bits=p.info.bits,
                           group_size=p.info.group_size, out_features=p.rows[1] - p.rows[0],
                           in_features=p.cols[1] - p.cols[0])


def _tq_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            key: str) -> torch.Tensor:
    st: MoEState = _LAYERS[key].__dict__["tq_moe"]
    out = torch.zeros(x.shape[0], st.experts[0]["down"].rows[1], dtype=torch.float32,
                      device=x.device)
    gate_rot = st.rotations.get("gate")
    # Every expert's gate and up read x in one rotated basis: rotate once.
    x_rot = dispatch.rotate(x, gate_rot[0], gate_rot[1]) if gate_rot is not None else x
    weights = topk_weights.reshape(-1)
    for e, rows, picked in routed(topk_ids, len(st.experts)):
        roles = st.experts[e]
        xe = x_rot[rows]
        h = F.silu(_linear(xe, roles["gate"], None)) * _linear(xe, roles["up"], None)
        y = _linear(h, roles["down"], st.rotations.get("down"))
        out.index_add_(0, rows, y.float() * weights[picked, None].float())
    return out.to(x.dtype)


def _tq_moe_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 key: str) -> torch.Tensor:
    return torch.empty_like(x)


@functools.lru_cache(maxsize=1)
def register_op() -> None:
    """`torch.ops.vllm.tq_moe`, once per process."""
    direct_register_custom_op("tq_moe", _tq_moe, mutates_args=[], fake_impl=_tq_moe_fake)

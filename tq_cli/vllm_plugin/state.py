"""Run-time state of tq's vLLM layers, shared by config.py (linear layers) and vocab.py
(the embedding and lm_head): what a layer holds besides its parameters, and the layers by
key for the custom ops (which take a string key that torch.compile keeps as a constant)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from tq_cli.vllm_plugin.info import LayerInfo
from tq_kernels.reference import Material


@dataclass(frozen=True)
class Part:
    """One logical weight of a (possibly merged) layer on this rank."""

    name: str
    info: LayerInfo
    rows: tuple[int, int]  # of the full weight, held by this rank
    cols: tuple[int, int]
    offset: int  # first row of this part in the layer's local storage


# Layers by key, for the custom op (which takes the key, a string torch.compile keeps as a
# constant). Weak values: an engine that is shut down frees its layers.
LAYERS: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()


@dataclass
class LayerState:
    """What a tq layer needs at run time, kept off the module's parameters."""

    prefix: str
    parts: list[Part]
    n_local: int
    bits: int
    group_size: int
    out_features: int
    staged: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    outlier_starts: list[int] = field(default_factory=list)
    rotation: Material | None = None
    block: int = 0
    key: str = ""


def layer_state(layer: nn.Module) -> LayerState:
    state = layer.__dict__.get("tq_state")
    if not isinstance(state, LayerState):
        raise RuntimeError(f"tq: {type(layer).__name__} has no tq state")
    return state


__all__ = ["LAYERS", "LayerState", "Part", "layer_state"]

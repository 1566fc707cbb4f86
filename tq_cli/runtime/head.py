"""lm_head (and a tied input embedding) quantized when a model is loaded.

A small model's fp32 lm_head is a large share of what a decode step reads: SmolLM2-135M's
is 49152 x 576, 113 MB per token, against 56 MB for all its converted layers at 4 bits.
`quantize_head` fits it with tq's quantizer (a Hadamard rotation, groups of 128, the
weight-only fit, no column scales) into a TQLinear, so the head runs on the same kernels
as every converted layer. Where the input embedding is tied to the head, it becomes a
`TQEmbedding` reading the same packed weight (the two stay one tensor): a lookup
dequantizes only the rows it is asked for and rotates them back. The head is fitted
without exact outliers, so a row is its codes and scales alone.

`quantize_head` is the load-time option (`tq_cli.load(..., head_bits=8)`) for a
checkpoint that keeps its head in full precision; `tq convert --head-bits` stores the head
quantized the same way (tq_cli.quant.head), and the loader then builds the TQEmbedding
over the stored buffers (tq_cli.runtime.hf_quantizer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tq_cli.errors import UnsupportedError
from tq_cli.io.format import SUFFIXES
from tq_cli.quant.head import (
    HEAD_BITS,
    HEAD_GROUP,
    embedding_rows,
    finish_head,
    head_rotation,
    head_spec,
)
from tq_cli.quant.prepare import quantize
from tq_cli.runtime.tq_linear import RotationMaterial, TQLinear


class TQEmbedding(nn.Module):
    """An input embedding whose table is a tied lm_head's packed weight (a TQLinear).

    owner: the embedding holds the packed buffers, as its child `weight`, and the head
    reads them (a checkpoint that stores the tied head: its keys are the embedding's,
    `model.embed_tokens.weight.codes`, ...); otherwise the head holds them (a head
    quantized as it loads). Either way there is one copy."""

    def __init__(self, head: TQLinear, dtype: torch.dtype, owner: bool = False) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a child: the head is the model's lm_head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        if owner:
            packed = head._modules.pop("weight")
            head.__dict__["weight"] = packed  # still `head.weight`, no longer its child
            self.weight = packed

    @property
    def head(self) -> TQLinear:
        return self.__dict__["head"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, w, rot = self.head, self.head.weight, self.head.rotation
        x = embedding_rows(ids, w.codes, w.scales, w.codebook, h.bits, h.group_size,
                           h.in_features, rot.signs if rot is not None else None,
                           rot.block if rot is not None else 0)
        return x.to(self.dtype).reshape(*ids.shape, -1)


def quantize_head(model: Any, bits: int) -> dict[str, Any]:
    """Replace model's lm_head with a TQLinear of `bits` (and its tied input embedding with
    a TQEmbedding of the same weight); returns what was done, for `tq_report`."""
    if bits not in HEAD_BITS:
        raise UnsupportedError(f"head_bits must be one of {', '.join(map(str, HEAD_BITS))}, "
                               f"got {bits}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, TQLinear):
        raise UnsupportedError(f"head_bits: the checkpoint stores lm_head quantized already "
                               f"({head.bits} bits); load it with head_bits=None")
    if not isinstance(head, nn.Linear) or head.weight.device.type == "meta":
        raise UnsupportedError(f"head_bits: {type(model).__name__} has no linear lm_head "
                               "to quantize")
    emb = model.get_input_embeddings()
    w = head.weight.detach()
    # A plain embedding only: a subclass may scale its lookups (Gemma's multiplies by
    # sqrt(hidden)) or renormalise them (max_norm); then the head alone is quantized and
    # the embedding keeps its own (formerly shared) weight.
    tied = (type(emb) is nn.Embedding and emb.max_norm is None
            and emb.weight.data_ptr() == w.data_ptr())
    q = finish_head(quantize(w.float(), head_spec(bits), head_rotation(), device=w.device), w)
    dev = w.device
    layer = TQLinear(w.shape[1], w.shape[0], bits=bits, group_size=HEAD_GROUP, specs={})
    for suffix in SUFFIXES:
        layer.weight.register_buffer(suffix, getattr(q, suffix).to(dev))
    if head.bias is not None:
        layer.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=False)
    rot = RotationMaterial("hadamard", q.rotation.block, {})
    assert q.rotation.signs is not None
    rot.register_buffer("signs", q.rotation.signs.to(dev))
    layer.set_rotation(rot)
    layer.head_rotation = rot  # the head's own material, kept alive with the layer
    model.set_output_embeddings(layer)
    if tied:
        model.set_input_embeddings(TQEmbedding(layer, emb.weight.dtype))
    return {"bits": bits, "tied": tied, "rel_error": q.rel_error,
            "bytes": layer.memory_bytes() + q.rotation.signs.numel(),
            "fp_bytes": w.numel() * w.element_size()}


__all__ = ["HEAD_BITS", "TQEmbedding", "quantize_head"]

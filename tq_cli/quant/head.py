"""How tq quantizes a model's lm_head (and the input embedding tied to it).

One definition for `tq convert --head-bits` and the load-time option
(`tq_cli.load(..., head_bits=)`): groups of 128 under a Hadamard rotation, no exact
outliers (a lookup of one embedding row then reads only that row's codes and scales), no
column scales (the embedding's rows come out in the original basis after one inverse
rotation), and the weight-only fit. 8 bits use the uniform codebook on an integer grid
(`integer_levels`), which the CPU kernel decodes with a convert and an fma instead of a
gather from the codebook; 4 bits use the Lloyd-Max codebook, as converted layers do.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from tq_cli.quant.grouped import (
    QuantizedTensor,
    dequantize,
    dequantize_rows,
    row_blocks,
    sq_norm,
)
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels.reference import dequantize_codes
from tq_kernels.rotation import hadamard_unrotate

HEAD_BITS = (4, 8)
HEAD_GROUP = 128


def head_spec(bits: int) -> QuantSpec:
    """The quantization of a head at `bits` (8 or 4)."""
    return QuantSpec(bits=bits, group_size=HEAD_GROUP, outliers=0.0,
                     codebook="uniform" if bits == 8 else "lloyd-max")


def head_rotation(seed: int = 0) -> RotationSpec:
    """A head's rotation: Hadamard (an embedding lookup undoes it row by row), from the
    conversion's seed (`--seed`, 0 by default; per-tensor `--seeds` do not apply to it;
    the load-time head uses 0)."""
    return RotationSpec(kind="hadamard", seed=seed)


def embedding_rows(ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   codebook: torch.Tensor, bits: int, group_size: int, in_features: int,
                   signs: torch.Tensor | None, block: int) -> torch.Tensor:
    """Rows `ids` of a head stored without outliers, in the original basis (float32,
    [ids.numel(), in_features]): only those rows' codes and scales are dequantized, then
    the Hadamard rotation (`signs`, `block`; None: none) is undone. An input embedding
    tied to the head looks its tokens up this way (transformers and vLLM)."""
    rows = ids.reshape(-1).long()
    x = dequantize_codes(codes[rows], scales[rows], codebook, bits=bits,
                         group_size=group_size, in_features=in_features)
    return hadamard_unrotate(x, signs, block) if signs is not None else x


def integer_levels(q: QuantizedTensor) -> QuantizedTensor:
    """An 8-bit uniform fit with its levels rescaled to k - 127.5 (the scales divided to
    match): an exact affine grid, which the CPU kernel decodes with a convert and an fma
    instead of a gather from the codebook (tq_kernels csrc/common.h, affine_levels)."""
    half = (q.codebook.numel() - 1) / 2
    levels = torch.arange(q.codebook.numel(), dtype=torch.float32) - half
    scales = (q.scales.float() * (float(q.codebook[-1]) / half)).half()
    return replace(q, codebook=levels.to(q.codebook.device), scales=scales)


def finish_head(q: QuantizedTensor, w: torch.Tensor | None = None,
                rotated: bool = False) -> QuantizedTensor:
    """A head's fit as stored: 8 bits on the integer grid (its fp16 scales rounded again,
    so `rel_error` is measured again against `w`, the weight it stands for, in the rotated
    basis where `rotated`), 4 bits as fitted."""
    if q.spec.bits != 8:
        return q
    q = integer_levels(q)
    if w is None:
        return q
    if rotated:  # a block of rows at a time: no full-size copies beside w
        sq = 0.0
        for r0, r1 in row_blocks(q):
            d = w[r0:r1].float() - dequantize_rows(q, r0, r1).to(w.device)
            sq += float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2
        err = math.sqrt(sq)
    else:
        err = float(torch.linalg.vector_norm(w.float() - dequantize(q).to(w.device),
                                             dtype=torch.float64))
    norm = math.sqrt(sq_norm(w))
    return replace(q, rel_error=(err / norm) ** 2 if norm else 0.0)


__all__ = ["HEAD_BITS", "HEAD_GROUP", "embedding_rows", "finish_head", "head_rotation", "head_spec",
           "integer_levels"]

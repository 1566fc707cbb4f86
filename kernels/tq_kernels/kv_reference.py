"""Attention on TurboQuant KV codes, the torch reference: the two products a decode step
needs from coded tokens, without decoding any token to a full vector.

A coded token t of one head stores packed codes (tq_kernels.packing, `bits` per
coordinate, in the basis of the codec's rotation) and an fp16 scale s_t whose sign the
cache uses as a flag (only |s_t| is a magnitude here). With levels L (the codebook):

    score_codes:      out[b, h, g, t] = |s[b, h, t]| * sum_j q[b, h, g, j] * L[code[b, h, t, j]]
    accumulate_codes: out[b, h, g, j] = sum_t p[b, h, g, t] * |s[b, h, t]| * L[code[b, h, t, j]]

q is the query already rotated into the codes' basis (q @ R), g indexes the query heads
that share key/value head h (GQA), and the accumulated values come out in the rotated
basis (the caller rotates back once per head). These are the reference the native CPU
kernel (tq_kernels.kv) and the Triton kernel (tq_kernels.kv_triton) are tested against.
"""

from __future__ import annotations

import torch

from tq_kernels.packing import packed_row_bytes, unpack_codes


def _levels(codes: torch.Tensor, levels: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """float32 [B, H, T, d]: the codebook value of every code."""
    b, h, t, nbytes = codes.shape
    idx = unpack_codes(codes.reshape(-1, nbytes), bits, d).long()
    return levels.float()[idx].reshape(b, h, t, d)


def check(q_or_p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
          levels: torch.Tensor, bits: int, d: int) -> None:
    """The inputs' shapes and types, as every implementation checks them (ValueError)."""
    if q_or_p.dim() != 4 or codes.dim() != 4 or scale.dim() != 3:
        raise ValueError("expected q/p [B, H, G, *], codes [B, H, T, bytes], scale [B, H, T]")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[:3] != scale.shape or q_or_p.shape[:2] != codes.shape[:2]:
        raise ValueError(f"shapes do not agree: {tuple(q_or_p.shape)}, {tuple(codes.shape)}, "
                         f"{tuple(scale.shape)}")
    if d < 1:
        raise ValueError(f"d must be positive, got {d}")
    nbytes = codes.shape[-1]
    if nbytes != packed_row_bytes(d, bits):
        raise ValueError(f"codes have {nbytes} bytes per token, {bits}-bit codes of {d} "
                         f"coordinates need {packed_row_bytes(d, bits)}")
    if levels.dim() != 1 or levels.numel() < 2 ** bits:
        raise ValueError(f"levels must be a vector of {2 ** bits} values, got "
                         f"{tuple(levels.shape)}")
    if q_or_p.shape[2] < 1:
        raise ValueError("G (query heads per KV head) must be at least 1")


def score_codes(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                levels: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 [B, H, G, T]: |s_t| <q_g, L[codes_t]> (see the module docstring)."""
    check(q, codes, scale, levels, bits, q.shape[-1])
    lv = _levels(codes, levels, bits, q.shape[-1])
    out = torch.einsum("bhgd,bhtd->bhgt", q.float(), lv)
    return out * scale.float().abs()[:, :, None, :]


def accumulate_codes(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     levels: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """float32 [B, H, G, d]: sum_t p_t |s_t| L[codes_t] (see the module docstring)."""
    check(p, codes, scale, levels, bits, d)
    if p.shape[-1] != codes.shape[2]:
        raise ValueError(f"p has {p.shape[-1]} tokens, codes {codes.shape[2]}")
    lv = _levels(codes, levels, bits, d)
    w = p.float() * scale.float().abs()[:, :, None, :]
    return torch.einsum("bhgt,bhtd->bhgd", w, lv)

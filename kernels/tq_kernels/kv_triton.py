# mypy: allow-untyped-defs
"""Attention on TurboQuant KV codes, the Triton kernels: the two products a decode step
needs from coded tokens (semantics and reference: tq_kernels.kv_reference).

    score_codes:      out[b, h, g, t] = |s[b, h, t]| * sum_j q[b, h, g, j] * L[code[b, h, t, j]]
    accumulate_codes: out[b, h, g, j] = sum_t p[b, h, g, t] * |s[b, h, t]| * L[code[b, h, t, j]]

Codes are unpacked from their bit planes (layout: tq_kernels.packing) and looked up in
the codebook in registers; no token is ever decoded to memory.

score: one program per (b, h, block of BLOCK_T tokens) loads the tokens' codes once and
computes the scores of all G query heads that share head h from that one tile.

accumulate: one program per (b, h, block of BLOCK_D channels, token split) walks its
tokens in BLOCK_T steps, keeping the [G, BLOCK_D] sums in registers. With one split (short
caches, or many heads) it writes the result; with several, each split writes a partial
sum and a second kernel adds the partials in split order. The split count is a function
of the shapes only, so a result is deterministic (no atomics) for given inputs.

Importing this module imports Triton; tests run it on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tq_kernels import kv_reference
from tq_kernels.packing import PLANES, padded_length

# Programs the split-T accumulate aims to launch before splitting stops paying off; a
# function of the shapes only (never of the device), so results do not depend on the GPU.
_TARGET_PROGRAMS = 256
# Fewest tokens one split of accumulate walks.
_MIN_SPLIT_TOKENS = 256


@triton.jit
def _code_levels(row_ptrs, j, mask, lv_ptr, plane1_off, plane2_off,
                 W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Codebook values of codes j of the rows at row_ptrs (broadcast together), 0 where
    masked. Up to three bit planes of widths W0, W1, W2 (0: absent), lowest bits first."""
    b0 = tl.load(row_ptrs + (j * W0) // 8, mask=mask, other=0).to(tl.int32)
    code = (b0 >> ((j * W0) % 8)) & ((1 << W0) - 1)
    if W1 > 0:
        b1 = tl.load(row_ptrs + plane1_off + (j * W1) // 8, mask=mask, other=0).to(tl.int32)
        code = code | (((b1 >> ((j * W1) % 8)) & ((1 << W1) - 1)) << W0)
    if W2 > 0:
        b2 = tl.load(row_ptrs + plane2_off + (j * W2) // 8, mask=mask, other=0).to(tl.int32)
        code = code | (((b2 >> ((j * W2) % 8)) & ((1 << W2) - 1)) << (W0 + W1))
    return tl.load(lv_ptr + code, mask=mask, other=0.0)


@triton.jit
def _score_kernel(
    q_ptr, codes_ptr, scale_ptr, lv_ptr, out_ptr,
    H, T, D, plane1_off, plane2_off,
    sq_b, sq_h, sq_g,
    sc_b, sc_h, sc_t,
    ss_b, ss_h, ss_t,
    so_b, so_h, so_g,
    G: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rj = tl.arange(0, BLOCK_D)
    tmask = rt < T
    jmask = rj < D
    rows = codes_ptr + b * sc_b + h * sc_h + rt.to(tl.int64)[:, None] * sc_t
    lv = _code_levels(rows, rj[None, :], tmask[:, None] & jmask[None, :], lv_ptr,
                      plane1_off, plane2_off, W0, W1, W2)          # [BLOCK_T, BLOCK_D]
    s = tl.load(scale_ptr + b * ss_b + h * ss_h + rt.to(tl.int64) * ss_t, mask=tmask,
                other=0.0).to(tl.float32)
    s = tl.abs(s)
    q_base = q_ptr + b * sq_b + h * sq_h
    out_base = out_ptr + b * so_b + h * so_h
    for g in tl.static_range(G):
        qg = tl.load(q_base + g * sq_g + rj, mask=jmask, other=0.0).to(tl.float32)
        dot = tl.sum(lv * qg[None, :], axis=1)
        tl.store(out_base + g * so_g + rt, dot * s, mask=tmask)


@triton.jit
def _accumulate_kernel(
    p_ptr, codes_ptr, scale_ptr, lv_ptr, out_ptr,
    H, T, D, split_tokens, plane1_off, plane2_off,
    sp_b, sp_h, sp_g,
    sc_b, sc_h, sc_t,
    ss_b, ss_h, ss_t,
    so_s, so_b, so_h, so_g,
    G: tl.constexpr, BLOCK_G: tl.constexpr,
    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rj = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rg = tl.arange(0, BLOCK_G)
    jmask = rj < D
    gmask = rg < G
    rows_base = codes_ptr + b * sc_b + h * sc_h
    s_base = scale_ptr + b * ss_b + h * ss_h
    p_base = p_ptr + b * sp_b + h * sp_h + rg[:, None] * sp_g
    t_start = pid_s * split_tokens
    t_end = tl.minimum(T, t_start + split_tokens)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t0 in range(t_start, t_end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        tmask = rt < t_end
        rt64 = rt.to(tl.int64)
        lv = _code_levels(rows_base + rt64[:, None] * sc_t, rj[None, :],
                          tmask[:, None] & jmask[None, :], lv_ptr, plane1_off, plane2_off,
                          W0, W1, W2)                                # [BLOCK_T, BLOCK_D]
        s = tl.abs(tl.load(s_base + rt64 * ss_t, mask=tmask, other=0.0).to(tl.float32))
        p = tl.load(p_base + rt64[None, :], mask=gmask[:, None] & tmask[None, :],
                    other=0.0).to(tl.float32)                        # [BLOCK_G, BLOCK_T]
        w = p * s[None, :]
        acc += tl.sum(w[:, :, None] * lv[None, :, :], axis=1)
    out = out_ptr + pid_s * so_s + b * so_b + h * so_h + rg[:, None] * so_g + rj[None, :]
    tl.store(out, acc, mask=gmask[:, None] & jmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, S, BLOCK: tl.constexpr):
    """out[i] = sum_s part[s, i], s in increasing order: the fixed-order second pass."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = r < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * N + r, mask=mask, other=0.0)
    tl.store(out_ptr + r, acc, mask=mask)


def _check(q_or_p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
           levels: torch.Tensor, bits: int, d: int) -> tuple[int, int, int]:
    """Validate as the reference does; return the bit-plane widths (W0, W1, W2)."""
    if bits not in PLANES or len(PLANES[bits]) > 3:
        raise NotImplementedError(f"kv_triton: {bits}-bit codes are not supported")
    kv_reference.check(q_or_p, codes, scale, levels, bits, d)
    planes = (*PLANES[bits], 0, 0)
    return planes[0], planes[1], planes[2]


def _prepare(codes: torch.Tensor, levels: torch.Tensor,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    return codes, levels.to(device=device, dtype=torch.float32).contiguous()


def _plane_offsets(d: int, w0: int, w1: int) -> tuple[int, int]:
    npad = padded_length(d)
    return npad * w0 // 8, npad * (w0 + w1) // 8


def score_codes(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                levels: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 [B, H, G, T]: |s_t| <q_g, L[codes_t]>; same contract as
    tq_kernels.kv_reference.score_codes."""
    d = q.shape[-1]
    w0, w1, w2 = _check(q, codes, scale, levels, bits, d)
    bsz, heads, groups, _ = q.shape
    t = codes.shape[2]
    out = torch.empty(bsz, heads, groups, t, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    codes, lv = _prepare(codes, levels, q.device)
    block_d = triton.next_power_of_2(d)
    block_t = max(16, min(64, 4096 // block_d))
    p1, p2 = _plane_offsets(d, w0, w1)
    grid = (bsz * heads, triton.cdiv(t, block_t))
    _score_kernel[grid](
        q, codes, scale, lv, out,
        heads, t, d, p1, p2,
        q.stride(0), q.stride(1), q.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        G=groups, W0=w0, W1=w1, W2=w2, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return out


def _split_tokens(t: int, programs: int, block_t: int) -> int:
    """Tokens per split of accumulate: one split unless there are too few programs to
    fill a GPU and enough tokens to share out; a multiple of block_t."""
    splits = min(triton.cdiv(_TARGET_PROGRAMS, programs), triton.cdiv(t, _MIN_SPLIT_TOKENS))
    splits = max(1, splits)
    return triton.cdiv(triton.cdiv(t, splits), block_t) * block_t


def accumulate_codes(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     levels: torch.Tensor, bits: int, d: int, *,
                     split_tokens: int | None = None) -> torch.Tensor:
    """float32 [B, H, G, d]: sum_t p_t |s_t| L[codes_t]; same contract as
    tq_kernels.kv_reference.accumulate_codes. split_tokens (default: chosen from the
    shapes) sets how many tokens one program sums before the fixed-order second pass
    adds the splits."""
    w0, w1, w2 = _check(p, codes, scale, levels, bits, d)
    if p.shape[-1] != codes.shape[2]:
        raise ValueError(f"p has {p.shape[-1]} tokens, codes {codes.shape[2]}")
    bsz, heads, groups, t = p.shape
    out = torch.zeros(bsz, heads, groups, d, dtype=torch.float32, device=p.device)
    if out.numel() == 0 or t == 0:
        return out
    if p.stride(-1) != 1:
        p = p.contiguous()
    codes, lv = _prepare(codes, levels, p.device)
    block_g = triton.next_power_of_2(groups)
    block_d = min(64, triton.next_power_of_2(d))
    block_t = max(16, min(64, 8192 // (block_g * block_d)))
    n_d = triton.cdiv(d, block_d)
    if split_tokens is None:
        split_tokens = _split_tokens(t, bsz * heads * n_d, block_t)
    elif split_tokens < 1:
        raise ValueError(f"split_tokens must be positive, got {split_tokens}")
    splits = triton.cdiv(t, split_tokens)
    if splits == 1:
        dest = out.unsqueeze(0)
    else:
        dest = torch.empty(splits, bsz, heads, groups, d, dtype=torch.float32, device=p.device)
    p1, p2 = _plane_offsets(d, w0, w1)
    grid = (bsz * heads, n_d, splits)
    _accumulate_kernel[grid](
        p, codes, scale, lv, dest,
        heads, t, d, split_tokens, p1, p2,
        p.stride(0), p.stride(1), p.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        dest.stride(0), dest.stride(1), dest.stride(2), dest.stride(3),
        G=groups, BLOCK_G=block_g, W0=w0, W1=w1, W2=w2, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    if splits > 1:
        n = out.numel()
        block = 1024
        _sum_splits_kernel[(triton.cdiv(n, block),)](dest, out, n, splits, BLOCK=block)
    return out

"""Triton kernels: the fused grouped lookup-table matmul and the blockwise rotations.

Importing this module imports Triton; `tq_kernels.dispatch` does so only when a CUDA
tensor asks for a kernel, and tests run these kernels on CPU under TRITON_INTERPRET=1.
Each kernel computes what its twin in `tq_kernels.reference` computes.

grouped_matmul: each program owns a BLOCK_M x BLOCK_N tile of y and walks K in
BLOCK_K steps, unpacking codes from their bit planes (layout: tq_kernels.packing),
looking levels up in the codebook and multiplying by the group scale in registers,
so the dequantized weight never exists in global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tq_kernels.packing import PLANES, padded_length
from tq_kernels.rotation import hadamard_blocks


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, cb_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes, n_groups, plane1_off,
    W0: tl.constexpr, W1: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        wmask = (rn[:, None] < N) & kmask[None, :]
        row = codes_ptr + rn[:, None] * row_bytes
        b0 = tl.load(row + (rk[None, :] * W0) // 8, mask=wmask, other=0).to(tl.int32)
        code = (b0 >> ((rk[None, :] * W0) % 8)) & ((1 << W0) - 1)
        if W1 > 0:
            b1 = tl.load(row + plane1_off + (rk[None, :] * W1) // 8, mask=wmask,
                         other=0).to(tl.int32)
            code = code | (((b1 >> ((rk[None, :] * W1) % 8)) & ((1 << W1) - 1)) << W0)
        level = tl.load(cb_ptr + code, mask=wmask, other=0.0)
        scale = tl.load(scales_ptr + rn[:, None] * n_groups + rk[None, :] // GROUP,
                        mask=wmask, other=0.0).to(tl.float32)
        w = level * scale
        if DOT_DTYPE == "fp32":
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        elif DOT_DTYPE == "fp16":
            acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
        else:
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_DOT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Above this many rows the fused kernel's advantage (reading 4-bit weights instead of
# fp16) is outweighed by cuBLAS's tensor-core efficiency, so the weight is dequantized
# once and multiplied with F.linear. Not yet tuned on a GPU; see scripts/gpu_check.sh.
DEQUANT_ABOVE_ROWS = 64


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   codebook: torch.Tensor, *, bits: int, group_size: int, out_features: int,
                   in_features: int) -> torch.Tensor:
    """y = x @ dequant(W).T, fused; same contract as tq_kernels.reference.grouped_matmul."""
    if x.dtype not in _DOT:
        raise TypeError(f"grouped_matmul: activations must be fp32, fp16 or bf16, got {x.dtype}")
    planes = PLANES[bits]
    if len(planes) > 2:
        raise ValueError(f"grouped_matmul: {bits}-bit codes are not supported by the kernel")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    m = x2.shape[0]
    if m > DEQUANT_ABOVE_ROWS and x.is_cuda:
        from tq_kernels.reference import dequantize_codes

        w = dequantize_codes(codes, scales, codebook, bits=bits, group_size=group_size,
                             in_features=in_features).to(x.dtype)
        return torch.nn.functional.linear(x2, w).reshape(*lead, out_features)
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n))
    _grouped_matmul_kernel[grid](
        x2, codes, scales, codebook.float().contiguous(), y,
        m, out_features, in_features, x2.stride(0), y.stride(0), codes.shape[1],
        scales.shape[1], padded_length(in_features) * planes[0] // 8,
        W0=planes[0], W1=planes[1] if len(planes) > 1 else 0, GROUP=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=_DOT[x.dtype],
    )
    return y.reshape(*lead, out_features)


@triton.jit
def _hadamard_kernel(x_ptr, signs_ptr, y_ptr, M, stride_m, col0, scale,
                     B: tl.constexpr, LOG_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """One B-wide block of rows: y = WHT(x * s) / sqrt(B), in O(B log B) per row.

    The butterflies use the constant-geometry (Pease) ordering: every stage pairs
    element i with element i + B/2 and writes them to 2i and 2i + 1, so all shapes are
    compile-time constants; log2(B) such stages give Sylvester's Hadamard transform.
    """
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col0 + pid_b * B + tl.arange(0, B)
    mask = rm[:, None] < M
    ptrs = rm[:, None] * stride_m + cols[None, :]
    x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    x = x * tl.load(signs_ptr + cols).to(tl.float32)[None, :]
    for _ in tl.static_range(LOG_B):
        x = tl.permute(tl.reshape(x, (BLOCK_M, 2, B // 2)), (0, 2, 1))
        a, c = tl.split(x)
        x = tl.reshape(tl.join(a + c, a - c), (BLOCK_M, B))
    tl.store(y_ptr + ptrs, (x * scale).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_matmul_kernel(x_ptr, q_ptr, y_ptr, M, stride_m, col0, b,
                         BP: tl.constexpr, BLOCK_M: tl.constexpr):
    """One b-wide block of rows times the b x b matrix Q (b padded to BP >= 16)."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BP)
    cols = col0 + pid_b * b + j
    mask = (rm[:, None] < M) & (j[None, :] < b)
    x = tl.load(x_ptr + rm[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
    q = tl.load(q_ptr + j[:, None] * b + j[None, :], mask=(j[:, None] < b) & (j[None, :] < b),
                other=0.0)
    y = tl.dot(x.to(tl.float32), q, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * stride_m + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask)


def rotate(x: torch.Tensor,
           material: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None],
           block: int) -> torch.Tensor:
    """x @ R blockwise; same contract as tq_kernels.reference.rotate."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2)
    block_m = 16
    if isinstance(material, torch.Tensor):
        signs = material.contiguous()
        pieces: list[tuple[int, int, int]] = []  # (start, size, count) of equal blocks
        for start, size in hadamard_blocks(n, block):
            if pieces and pieces[-1][1] == size and pieces[-1][0] + pieces[-1][1] * \
                    pieces[-1][2] == start:
                pieces[-1] = (pieces[-1][0], size, pieces[-1][2] + 1)
            else:
                pieces.append((start, size, 1))
        for start, size, count in pieces:
            if size == 1:  # a lone column: only its sign
                y[:, start] = x2[:, start] * signs[start].to(x2.dtype)
                continue
            _hadamard_kernel[(triton.cdiv(m, block_m), count)](
                x2, signs, y, m, x2.stride(0), start, size ** -0.5,
                B=size, LOG_B=size.bit_length() - 1, BLOCK_M=block_m)
    else:
        matrix, tail = material
        full = n // block
        if full:
            if matrix is None:
                raise ValueError(f"a {block} x {block} block matrix is needed for n={n}")
            _block_matmul_kernel[(triton.cdiv(m, block_m), full)](
                x2, matrix.float().contiguous(), y, m, x2.stride(0), 0, block,
                BP=max(16, triton.next_power_of_2(block)), BLOCK_M=block_m)
        if n % block:
            if tail is None:
                raise ValueError(f"a tail matrix of size {n % block} is needed for n={n}")
            r = n % block
            _block_matmul_kernel[(triton.cdiv(m, block_m), 1)](
                x2, tail.float().contiguous(), y, m, x2.stride(0), full * block, r,
                BP=max(16, triton.next_power_of_2(r)), BLOCK_M=block_m)
    return y.reshape(*lead, n)

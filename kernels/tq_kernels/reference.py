"""Pure-torch references of the kernels, with the same signatures.

They define what the Triton kernels must compute, and they are what runs on CPU.
"""

from __future__ import annotations

import torch

from tq_kernels.packing import PLANES, padded_length
from tq_kernels.rotation import hadamard_rotate, orthogonal_rotate

# Rotation material: a ±1 sign vector (Hadamard) or (matrix, tail) (orthogonal).
Material = torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None]


def _byte_table(values: torch.Tensor, width: int) -> torch.Tensor:
    """[256, 8 // width]: for every byte, the values of the codes packed in it."""
    per = 8 // width
    b = torch.arange(256, device=values.device)
    shifts = torch.arange(per, device=values.device) * width
    return values[(b[:, None] >> shifts) & ((1 << width) - 1)]


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor, *,
                     bits: int, group_size: int, in_features: int) -> torch.Tensor:
    """W_rot_hat [out, in] in float32: codebook[code] * scale of the code's group.

    Unpacks through 256-entry byte tables (one gather per plane, and for one-plane
    widths straight to levels), which is several times faster on CPU than shifting.
    """
    out, n = codes.shape[0], in_features
    npad = padded_length(n)
    cb = codebook.float()
    planes = PLANES[bits]
    if len(planes) == 1:
        levels = _byte_table(cb, bits)[codes.long()].reshape(out, npad)
    else:
        code = torch.zeros(out, npad, dtype=torch.long, device=codes.device)
        start = shift = 0
        for w in planes:
            nbytes = npad * w // 8
            table = _byte_table(torch.arange(1 << w, device=codes.device), w)
            code |= table[codes[:, start:start + nbytes].long()].reshape(out, npad) << shift
            start += nbytes
            shift += w
        levels = cb[code]
    groups = scales.shape[1]
    width = groups * group_size
    levels = levels[:, :n]
    if width != n:  # a partial last group: pad it out, multiply, cut it off again
        levels = torch.nn.functional.pad(levels, (0, width - n))
    w_hat = (levels.view(out, groups, group_size) * scales.float()[..., None]).view(out, width)
    return w_hat[:, :n].contiguous()


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   codebook: torch.Tensor, *, bits: int, group_size: int, out_features: int,
                   in_features: int) -> torch.Tensor:
    """y = x @ dequant(W).T for x [..., in]; y has x's dtype, accumulation in float32."""
    w = dequantize_codes(codes, scales, codebook, bits=bits, group_size=group_size,
                         in_features=in_features)
    assert w.shape == (out_features, in_features)
    return (x.float() @ w.T.to(x.device)).to(x.dtype)


def add_outliers(y: torch.Tensor, x_rot: torch.Tensor, outlier_idx: torch.Tensor,
                 outlier_val: torch.Tensor, in_features: int) -> torch.Tensor:
    """y + x_rot @ S.T for the sparse S with S.flat[idx] = val, computed exactly (in place)."""
    if outlier_idx.numel() == 0:
        return y
    idx = outlier_idx.long()
    rows, cols = idx // in_features, idx % in_features
    contrib = x_rot[..., cols].float() * outlier_val.float()
    flat = y.reshape(-1, y.shape[-1])
    acc = flat.float().index_add_(1, rows, contrib.reshape(-1, idx.numel()))
    return acc.to(y.dtype).reshape(y.shape)


def rotate(x: torch.Tensor, material: Material, block: int) -> torch.Tensor:
    """x @ R over the last dimension, R blockwise (see tq_kernels.rotation)."""
    if isinstance(material, torch.Tensor):
        return hadamard_rotate(x.float(), material, block).to(x.dtype)
    matrix, tail = material
    return orthogonal_rotate(x.float(), matrix, tail, block).to(x.dtype)

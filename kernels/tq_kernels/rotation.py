"""Blockwise rotations of the last dimension, pure torch (the reference the kernels match).

The rotation R is block diagonal over the input dimension n (docs/design.md, math 1):
`block`-sized blocks, then a tail of n % block columns.

- Randomized Hadamard: R_b = diag(s_b) H_b / sqrt(b) with Sylvester's H_b (b a power of
  two), applied as a fast Walsh-Hadamard transform in O(n log b). A tail that is not a
  power of two is split into power-of-two pieces by its binary expansion (72 = 64 + 8),
  so every n works.
- Orthogonal: one b x b orthogonal matrix Q shared by the full blocks, and its own
  r x r matrix for the tail of r columns.

`x @ R` is `*_rotate`; `x @ R.T` (the inverse) is `*_unrotate`.
"""

from __future__ import annotations

import math

import torch


def hadamard_blocks(n: int, block: int) -> list[tuple[int, int]]:
    """(start, size) of each Hadamard block covering n columns; every size a power of two."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {block}")
    out = [(i * block, block) for i in range(n // block)]
    start = (n // block) * block
    rest = n - start
    size = block
    while rest:
        size //= 2 if size > rest else 1
        if size <= rest:
            out.append((start, size))
            start += size
            rest -= size
    return out


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform of the last dimension (a power of two)."""
    b = x.shape[-1]
    if b & (b - 1):
        raise ValueError(f"Walsh-Hadamard size must be a power of two, got {b}")
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < b:
        y = y.reshape(*lead, b // (2 * h), 2, h)
        a, c = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + c, a - c), dim=-2)
        h *= 2
    return y.reshape(*lead, b)


def _blockwise_wht(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    nfull = n // block
    parts = []
    if nfull:
        head = x[..., : nfull * block].reshape(*x.shape[:-1], nfull, block)
        parts.append((walsh_hadamard(head) / math.sqrt(block)).reshape(*x.shape[:-1], -1))
    for start, size in hadamard_blocks(n, block)[nfull:]:
        parts.append(walsh_hadamard(x[..., start:start + size]) / math.sqrt(size))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x @ R for R = blockdiag(diag(s) H / sqrt(b)); signs is a ±1 vector of length n."""
    return _blockwise_wht(x * signs.to(x.dtype), block)


def hadamard_unrotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x @ R.T, the inverse of `hadamard_rotate` (H is symmetric)."""
    return _blockwise_wht(x, block) * signs.to(x.dtype)


def _blockwise_matmul(x: torch.Tensor, matrix: torch.Tensor | None,
                      tail: torch.Tensor | None, block: int, transpose: bool) -> torch.Tensor:
    n = x.shape[-1]
    nfull = n // block
    parts = []
    if nfull:
        if matrix is None or matrix.shape != (block, block):
            raise ValueError(f"a {block} x {block} block matrix is needed for n={n}")
        m = matrix.to(x.dtype).T if transpose else matrix.to(x.dtype)
        head = x[..., : nfull * block].reshape(*x.shape[:-1], nfull, block)
        parts.append((head @ m).reshape(*x.shape[:-1], -1))
    if n % block:
        if tail is None or tail.shape[0] != n % block:
            raise ValueError(f"a tail matrix of size {n % block} is needed for n={n}")
        t = tail.to(x.dtype)
        parts.append(x[..., nfull * block:] @ (t.T if transpose else t))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def orthogonal_rotate(x: torch.Tensor, matrix: torch.Tensor | None,
                      tail: torch.Tensor | None, block: int) -> torch.Tensor:
    """x @ R for R = blockdiag(Q, ..., Q, Q_tail)."""
    return _blockwise_matmul(x, matrix, tail, block, transpose=False)


def orthogonal_unrotate(x: torch.Tensor, matrix: torch.Tensor | None,
                        tail: torch.Tensor | None, block: int) -> torch.Tensor:
    """x @ R.T, the inverse of `orthogonal_rotate`."""
    return _blockwise_matmul(x, matrix, tail, block, transpose=True)

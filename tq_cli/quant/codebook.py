"""Codebooks: the 2**bits reconstruction levels, in units of a group's scale.

- `lloyd-max`: the MSE-optimal quantizer for N(0,1) (Lloyd 1982, Max 1960), computed by
  Lloyd's iteration on the Gaussian density. Rotated weights are close to Gaussian, so
  this is the starting point; `grouped` then refines it per tensor (1-D k-means).
- `uniform`: symmetric levels spanning [-1, 1]; with absmax scales this is plain
  round-to-nearest on a symmetric min-max grid.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from tq_cli.quant.spec import CodebookKind


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


@functools.cache
def lloyd_max_gaussian(levels: int, iters: int = 2000) -> tuple[tuple[float, ...], float]:
    """Lloyd-Max levels for N(0,1) and their MSE (e.g. 4 levels -> MSE 0.1175)."""
    c = [(-1.0 + 2.0 * (k + 0.5) / levels) * 2.5 for k in range(levels)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in itertools.pairwise(c)] + [math.inf]
        new = []
        for a, b in itertools.pairwise(edges):
            mass = _cdf(b) - _cdf(a)
            new.append((_phi(a) - _phi(b)) / mass if mass > 0 else (a + b) / 2)
        done = max(abs(x - y) for x, y in zip(c, new, strict=False)) < 1e-12
        c = new
        if done:
            break
    # MSE = E[x^2] - sum_k P_k c_k^2 for centroid quantizers.
    edges = [-math.inf] + [(a + b) / 2 for a, b in itertools.pairwise(c)] + [math.inf]
    mse = 1.0 - sum((_cdf(b) - _cdf(a)) * ck * ck
                    for ck, a, b in zip(c, edges, edges[1:], strict=False))
    return tuple(c), mse


def uniform_levels(levels: int) -> tuple[float, ...]:
    return tuple((2 * k - (levels - 1)) / (levels - 1) for k in range(levels))


def initial_codebook(kind: CodebookKind, bits: int) -> torch.Tensor:
    """Sorted float32 levels of the starting codebook."""
    levels = 1 << bits
    if kind == "lloyd-max":
        return torch.tensor(lloyd_max_gaussian(levels)[0], dtype=torch.float32)
    if kind == "uniform":
        return torch.tensor(uniform_levels(levels), dtype=torch.float32)
    raise ValueError(f"unknown codebook kind {kind!r}")


def nearest(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level (codebook sorted ascending) for every entry of z."""
    mids = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(z, mids)

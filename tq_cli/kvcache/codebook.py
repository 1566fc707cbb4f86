"""Lloyd-Max codebooks for one coordinate of a randomly rotated unit vector.

TurboQuant (Zandieh et al. 2025, arXiv:2504.19874, Section 3.1, Lemma 1): after a random
rotation, each coordinate of a unit vector in R^d follows the law
    f_d(y) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - y^2)^((d-3)/2),  y in [-1, 1],
close to N(0, 1/d) for large d. The optimal scalar quantizer of that law is found by
Lloyd's iteration (continuous 1-D k-means), here with Gauss-Legendre quadrature on each
cell, so the levels are exact for the given d and bit width (no sampling). The
distortion of a whole unit vector is d times the per-coordinate MSE: about 0.36, 0.117,
0.03 and 0.009 for 1-4 bits (the paper's Theorem 1 table).

Used by `tq_cli.kvcache.codec`; cached per (d, bits).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from tq_cli.quant.codebook import lloyd_max_gaussian

_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(96)


def _log_norm_const(d: int) -> float:
    return math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)


def _density(y: np.ndarray, d: int) -> np.ndarray:
    return np.exp(_log_norm_const(d) + (d - 3) / 2 * np.log1p(-np.minimum(y * y, 1.0)))


def _cell_moments(edges: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Mass and first moment of f_d over each cell [edges[k], edges[k+1]]."""
    a, b = edges[:-1, None], edges[1:, None]
    half = (b - a) / 2
    y = (a + b) / 2 + half * _NODES[None, :]
    f = _density(y, d) * _WEIGHTS[None, :] * half
    return f.sum(axis=1), (f * y).sum(axis=1)


@functools.cache
def sphere_codebook(d: int, bits: int, iters: int = 500) -> tuple[tuple[float, ...], float]:
    """Sorted Lloyd-Max levels for one coordinate of a random unit vector in R^d, and the
    per-coordinate MSE (multiply by d for the distortion of the whole vector)."""
    if d < 3:
        raise ValueError(f"the rotated-coordinate law needs d >= 3, got {d}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be between 1 and 8, got {bits}")
    levels = 1 << bits
    # Start from the Gaussian quantizer scaled to N(0, 1/d), the large-d limit of f_d.
    c = np.array(lloyd_max_gaussian(levels)[0]) / math.sqrt(d)
    c = np.clip(c, -0.999, 0.999)
    for _ in range(iters):
        edges = np.concatenate(([-1.0], (c[1:] + c[:-1]) / 2, [1.0]))
        mass, moment = _cell_moments(edges, d)
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), c)
        done = float(np.max(np.abs(new - c))) < 1e-13
        c = new
        if done:
            break
    edges = np.concatenate(([-1.0], (c[1:] + c[:-1]) / 2, [1.0]))
    mass, _ = _cell_moments(edges, d)
    # For centroid quantizers MSE = E[y^2] - sum_k P_k c_k^2, and E[y^2] = 1/d exactly.
    mse = 1.0 / d - float(np.sum(mass * c * c))
    return tuple(float(x) for x in c), mse


def distortion(d: int, bits: int) -> float:
    """Expected ||u - u_hat||^2 for a unit vector u in R^d (Theorem 1's D_mse)."""
    return d * sphere_codebook(d, bits)[1]

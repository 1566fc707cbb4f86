"""scripts/vq_study.py's GPTQ with vector codes: the numbers docs/results.md reports
come from this function, so it is checked against what GPTQ and vector codes promise."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from script_loader import load_script


def _study() -> ModuleType:
    return load_script("vq_study")


def _correlated(rows: int, seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gaussian weight [rows, 256] and the H of correlated inputs."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 256, generator=gen)
    x = torch.randn(tokens, 256, generator=gen) @ torch.randn(256, 256, generator=gen) * 0.1
    return w, x.T @ x / x.shape[0] + 0.01 * torch.eye(256)


def _up(h: torch.Tensor) -> torch.Tensor:
    """GPTQ's factor: the upper Cholesky factor of H^-1."""
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def _weighted(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - w_hat).double()
    return float(((d @ h.double()) * d).sum())


def test_each_code_minimises_the_error_gptq_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    """One code of two columns: the choice is the argmin of (w - s c) H (w - s c)^T over
    the codebook, H's off-diagonal included (a Euclidean choice would differ)."""
    vq = _study()
    gen = torch.Generator().manual_seed(2)
    book = torch.randn(64, 2, generator=gen)
    monkeypatch.setattr(vq, "kmeans", lambda x, k, seed=0: book)
    h = torch.tensor([[1.0, 0.9], [0.9, 1.0]])
    w = torch.randn(200, 2, generator=gen)
    w_hat = vq.gptq_vq(w, _up(h), 2, 3)
    s = w.pow(2).mean(1, keepdim=True).sqrt()
    d = w[:, None, :] - s[:, :, None] * book[None]  # [rows, codes, 2]
    best = torch.einsum("rki,ij,rkj->rk", d, h, d).argmin(1)
    assert torch.allclose(w_hat, s * book[best], atol=1e-6)
    euclid = d.pow(2).sum(-1).argmin(1)
    assert (best != euclid).any()  # the test tells the two rules apart


def test_lazy_batches_give_the_updates_of_column_by_column_gptq() -> None:
    vq = _study()
    w, h = _correlated(32, 3, 1024)
    for d in (1, 2):
        lazy = _weighted(w, vq.gptq_vq(w, _up(h), d, 3, block=128), h)
        eager = _weighted(w, vq.gptq_vq(w, _up(h), d, 3, block=d), h)
        assert abs(lazy - eager) <= 1e-3 * eager, d


def test_pairs_round_gaussian_weights_closer_than_scalar_codes_at_the_same_bits() -> None:
    vq = _study()
    w = torch.randn(64, 320, generator=torch.Generator().manual_seed(0))  # groups 128+128+64
    eye = torch.eye(320)
    err = {d: float((vq.gptq_vq(w, eye, d, 3) - w).pow(2).mean()) for d in (1, 2)}
    # Lloyd-Max's 8 levels leave 0.0345 of a unit Gaussian's variance; 64 points in 2-D
    # about 10% less
    assert 0.030 < err[1] < 0.040
    assert err[2] < 0.95 * err[1]


def test_error_feedback_lowers_the_output_error_for_every_code_width() -> None:
    vq = _study()
    w, h = _correlated(48, 1, 2048)
    for d in (1, 2, 4):
        plain = vq.gptq_vq(w, torch.eye(256), d, 2)  # no feedback: nearest codes
        fed = vq.gptq_vq(w, _up(h), d, 2)
        assert _weighted(w, fed, h) < 0.8 * _weighted(w, plain, h), d

"""Triton kernels under TRITON_INTERPRET=1 on CPU against their torch references."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import reference

tk = pytest.importorskip("tq_kernels.triton_kernels")


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [128, 200])  # a multiple of the group size, and not
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_matmul_matches_reference(bits: int, n: int, batch: int,
                                          dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(bits * 100 + n + batch)
    w = torch.randn(72, n, generator=g)
    q = quantize(w, QuantSpec(bits=bits, group_size=64), RotationSpec(kind="none"))
    x = torch.randn(batch, n, generator=g).to(dtype)
    args = (q.codes, q.scales, q.codebook)
    kw = {"bits": bits, "group_size": 64, "out_features": 72, "in_features": n}
    got = tk.grouped_matmul(x, *args, **kw)
    want = reference.grouped_matmul(x, *args, **kw)
    assert got.dtype == dtype and got.shape == (batch, 72)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    scale = want.float().abs().max()
    assert float((got.float() - want.float()).abs().max()) <= tol * float(scale) + 1e-5


def test_grouped_matmul_keeps_leading_dims() -> None:
    w = torch.randn(32, 64)
    q = quantize(w, QuantSpec(bits=4, group_size=32), RotationSpec(kind="none"))
    x = torch.randn(2, 3, 64)
    kw = {"bits": 4, "group_size": 32, "out_features": 32, "in_features": 64}
    got = tk.grouped_matmul(x, q.codes, q.scales, q.codebook, **kw)
    assert torch.allclose(got, reference.grouped_matmul(x, q.codes, q.scales, q.codebook, **kw),
                          atol=1e-4)


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize(("n", "block"), [(128, 64), (200, 64), (576, 128), (96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_matches_reference(kind: str, n: int, block: int, dtype: torch.dtype) -> None:
    rot = make_rotation(RotationSpec(kind=kind, seed=1), n, block)  # type: ignore[arg-type]
    material = rot.signs if kind == "hadamard" else (rot.matrix, rot.tail)
    x = torch.randn(5, n).to(dtype)
    got = tk.rotate(x, material, block)  # type: ignore[arg-type]
    want = reference.rotate(x, material, block)  # type: ignore[arg-type]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_outliers_added_exactly() -> None:
    y = torch.zeros(2, 4)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    idx = torch.tensor([0 * 3 + 2, 3 * 3 + 0], dtype=torch.int32)  # W[0,2] += 0.5, W[3,0] -= 1
    val = torch.tensor([0.5, -1.0], dtype=torch.float16)
    out = reference.add_outliers(y, x, idx, val, 3)
    assert out.tolist() == [[1.5, 0.0, 0.0, -1.0], [3.0, 0.0, 0.0, -4.0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("batch", [1, 16, 256])
def test_cuda_grouped_matmul(bits: int, batch: int) -> None:
    w = torch.randn(1024, 4096)
    q = quantize(w, QuantSpec(bits=bits), RotationSpec(kind="none"))
    x = torch.randn(batch, 4096, device="cuda", dtype=torch.float16)
    dev = [t.cuda() for t in (q.codes, q.scales, q.codebook)]
    kw = {"bits": bits, "group_size": 128, "out_features": 1024, "in_features": 4096}
    got = tk.grouped_matmul(x, *dev, **kw).float()
    want = reference.grouped_matmul(x.float(), *dev, **kw)
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max())

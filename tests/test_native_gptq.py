"""GPTQ's column loop in native code (tq_kernels.fit.gptq_block_) against the torch loop.

The torch loop (`tq_cli.quant.gptq._block_loop`) is the reference: for every bit width,
awkward shapes, outliers and every instruction set the native block gives the same codes
and the same errors and error-fed weights to float32 rounding (torch's rank-1 update
rounds once through BLAS for large sizes and twice in its own kernel for small ones; the
native one rounds once where the CPU has FMA), the same bits whatever the thread count,
and a whole calibrated quantization gives the same codes and weighted error.
"""

from __future__ import annotations

import pytest
import torch

from tq_cli.quant import factor, gptq
from tq_cli.quant.grouped import dequantize_rotated, fit_grid
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import fit

CPU = torch.device("cpu")


def _runs(isa: str) -> None:
    if not fit.available():
        pytest.skip("the native fit did not build here")
    if fit.ISAS.index(isa) > fit.ISAS.index(fit.cpu_isa()):
        pytest.skip(f"this CPU has no {isa}")


def _problem(out: int, n: int, bits: int, group: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g)
    x = torch.randn(3 * n, n, generator=g) * torch.linspace(0.2, 3.0, n)
    h = (x.T @ x).double() / x.shape[0]
    up = factor._inverse_cholesky(factor._checked_hessian(h, n, CPU), 0.01)
    spec = QuantSpec(bits=bits, group_size=group)
    scales, codebook = fit_grid(w, spec, CPU)
    return {"w": w, "h": h, "up": up, "scales": scales, "codebook": codebook, "spec": spec}


def _block(p: dict, isa: str | None, outliers: bool) -> tuple[torch.Tensor, ...]:
    """One block of 64 columns starting at column 8, native (isa) or torch (None)."""
    w, up, scales, codebook = p["w"], p["up"], p["scales"], p["codebook"].float()
    out, n = w.shape
    i1, i2 = 8, min(72, n)
    wt = w.T.contiguous()
    st = scales.T.contiguous().float()
    gcol = [j // p["spec"].group_size for j in range(n)]
    codes = torch.zeros(n, out, dtype=torch.uint8)
    q = torch.zeros(n, out)
    e = torch.empty(i2 - i1, out)
    rows = {j: torch.arange(j % 5, out, 7) for j in range(i1, i2, 3)} if outliers else {}
    w1 = wt[i1:i2]
    if isa is None:
        mids = (codebook[1:] + codebook[:-1]) / 2
        st_safe = torch.where(st > 0, st, torch.ones_like(st))
        gptq._block_loop(w1, up[i1:i2, i1:i2], e, i1, st, st_safe, gcol, mids, codebook,
                         rows, torch.diagonal(up).tolist(), codes, q)
    else:
        mask = None
        if rows:
            mask = torch.zeros(i2 - i1, out, dtype=torch.uint8)
            for j, r in rows.items():
                mask[j - i1, r] = 1
        fit.gptq_block_(w1, up[i1:i2, i1:i2].contiguous(), st,
                        torch.tensor(gcol[i1:i2]), codebook, mask, codes[i1:i2], q[i1:i2],
                        e, isa)
    return codes, q, e, wt


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize(("bits", "out", "n", "group"),
                         [(2, 100, 72, 32), (3, 96, 200, 64), (4, 129, 96, 32),
                          (8, 40, 80, 16)])
@pytest.mark.parametrize("outliers", [False, True])
def test_native_block_is_the_torch_loop_bit_for_bit(isa: str, bits: int, out: int, n: int,
                                                    group: int, outliers: bool) -> None:
    _runs(isa)
    p = _problem(out, n, bits, group)
    want = _block(p, None, outliers)
    got = _block(p, isa, outliers)
    assert torch.equal(got[0], want[0])  # codes
    # values, errors, error-fed weights: float32 rounding apart, except that an outlier's
    # residual rounded to fp16 can land one fp16 step away when the two loops' float32
    # values straddle a rounding midpoint (seen once in 48 cases: that entry's error moves
    # by the step over d_jj, 1.4e-5 of the block's error norm)
    for a, b in zip(got[1:], want[1:], strict=True):
        assert float((a - b).norm() / b.norm()) < 5e-5


def test_the_fma_instruction_sets_agree_bit_for_bit() -> None:
    _runs("avx512")
    p = _problem(129, 96, 4, 32)
    for a, b in zip(_block(p, "avx2", True), _block(p, "avx512", True), strict=True):
        assert torch.equal(a, b)


def test_native_block_does_not_depend_on_threads() -> None:
    _runs("scalar")
    p = _problem(700, 96, 4, 32)
    try:
        fit.set_threads(1)
        one = _block(p, fit.cpu_isa(), True)
        fit.set_threads(2)
        two = _block(p, fit.cpu_isa(), True)
    finally:
        fit.set_threads(0)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("act_order", [False, True])
def test_calibrated_quantization_is_the_same_with_either_loop(
        act_order: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("scalar")
    p = _problem(160, 192, 3, 64, seed=1)
    rot = make_rotation(RotationSpec(kind="hadamard"), 192, 64)
    runs = []
    for native in (False, True):  # the GPTQ loop only: the grid's fit is native for both
        monkeypatch.setattr(gptq, "native_available", lambda native=native: native)
        runs.append(gptq.quantize_calibrated(p["w"], p["h"], p["spec"], rot,
                                             act_order=act_order, device=CPU))
    a, b = runs
    assert a.outlier_idx.numel() > 0
    assert torch.equal(a.codebook, b.codebook)
    assert float((a.codes == b.codes).float().mean()) > 0.999
    assert float((a.outlier_idx == b.outlier_idx).float().mean()) > 0.99
    # quantize_calibrated takes the weight and H as given (the rotated basis)
    errs = [gptq.weighted_error(p["w"], dequantize_rotated(q), p["h"]) for q in runs]
    assert abs(errs[0] - errs[1]) / errs[0] < 1e-3


@pytest.mark.gpu
def test_gptq_on_cuda_matches_the_cpu() -> None:
    # On CUDA the torch loop runs on the GPU (the native loop is the CPU's); same result.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = _problem(512, 256, 4, 64, seed=2)
    rot = make_rotation(RotationSpec(kind="hadamard"), 256, 64)
    cpu = gptq.quantize_calibrated(p["w"], p["h"], p["spec"], rot, device=CPU)
    gpu = gptq.quantize_calibrated(p["w"].cuda(), p["h"].cuda(), p["spec"], rot,
                                   device=torch.device("cuda"))
    assert float((cpu.codes == gpu.codes).float().mean()) > 0.99

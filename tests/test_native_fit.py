"""The native CPU fit (tq_kernels.fit, csrc/fit_cpu.cpp) against the torch fit it replaces.

Correctness only, no timing: the same codes, scales, codebook, outliers and error as the
torch version (up to float summation order), every instruction-set variant, results that
do not depend on the thread count, the in-place rotation bit for bit, and the pipeline's
input checks. TQ_FIT=torch selects the torch version, which stays the CUDA path.
"""

from __future__ import annotations

import pytest
import torch

from tq_cli.bench.quality import matrix
from tq_cli.quant import grouped as quantizer
from tq_cli.quant.codebook import initial_codebook, nearest
from tq_cli.quant.grouped import dequantize_rotated, outlier_count, quantize_rotated
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import cpu_build, fit
from tq_kernels.packing import pack_codes
from tq_kernels.rotation import hadamard_rotate

if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine: tq quantizes with the torch fit",
                allow_module_level=True)

NONE = torch.empty(0, dtype=torch.long)


def _runs(isa: str) -> None:
    if fit.ISAS.index(isa) > fit.ISAS.index(fit.cpu_isa()):
        pytest.skip(f"this CPU has no {isa}")


def _both(w: torch.Tensor, spec: QuantSpec, monkeypatch: pytest.MonkeyPatch,
          isa: str | None = None) -> tuple[quantizer.QuantizedTensor, quantizer.QuantizedTensor]:
    """The torch fit and the native one (the variant `isa`, else the widest this CPU runs)."""
    rot = Rotation("none", w.shape[1], spec.group_size, 0)
    monkeypatch.setenv("TQ_FIT", "torch")
    ref = quantize_rotated(w, spec, rot)
    monkeypatch.delenv("TQ_FIT")
    if isa is not None:
        _runs(isa)
        monkeypatch.setattr(fit, "_cap", lambda: fit.ISAS.index(isa))
    return ref, quantize_rotated(w, spec, rot)


def _codebooks_agree(got: quantizer.QuantizedTensor, ref: quantizer.QuantizedTensor) -> None:
    """The same codebook up to summation order, and up to what a value sitting on a
    midpoint does. The codebook update sums each level's values in float64 in torch and per
    group in float32 natively, so levels can differ by an ulp; a scaled value within an ulp
    of a midpoint then takes the neighbouring level, and the next k-means update moves
    those two levels by about their gap over the values they hold (1/30 of it at 8 bits on
    a 40x200 tensor). Any variant can meet such a tie (AVX2 and scalar do on (40, 200) at
    8 bits, AVX-512 does not): allow two levels per differing code byte, each within a
    tenth of its gap to the nearest neighbour; every other level within float32 noise."""
    cb, rb = got.codebook, ref.codebook
    loose = ~torch.isclose(cb, rb, rtol=1e-4, atol=1e-5)
    flips = int((got.codes != ref.codes).sum())
    assert int(loose.sum()) <= 2 * flips, (int(loose.sum()), flips)
    gaps = rb.diff()
    gap = torch.minimum(torch.cat([gaps[:1], gaps]), torch.cat([gaps, gaps[-1:]]))
    assert bool(((cb - rb).abs() <= 0.1 * gap + 1e-5).all())


@pytest.mark.parametrize("isa", fit.ISAS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("shape", "group"), [((96, 576), 128), ((40, 200), 64),
                                              ((33, 104), 24), ((7, 8), 8)])
def test_native_fit_matches_torch(bits: int, shape: tuple[int, int], group: int, isa: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    w = matrix("heavy", shape, seed=bits)
    spec = QuantSpec(bits=bits, group_size=group)
    ref, got = _both(w, spec, monkeypatch, isa)
    assert got.codes.shape == ref.codes.shape and got.codes.dtype == torch.uint8
    assert got.scales.dtype == torch.float16 and got.outlier_val.dtype == torch.float16
    assert got.rel_error == pytest.approx(ref.rel_error, rel=2e-3, abs=1e-9)
    # float sums in another order can move a scale by one fp16 step and a value sitting
    # on a midpoint to the neighbouring level; nothing more
    assert float((got.codes == ref.codes).float().mean()) > 0.99
    assert torch.allclose(got.scales.float(), ref.scales.float(), rtol=2e-3, atol=1e-6)
    _codebooks_agree(got, ref)
    same = torch.isin(got.outlier_idx, ref.outlier_idx).float().mean() if ref.outlier_idx.numel() \
        else torch.tensor(1.0)
    assert float(same) > 0.95
    # what is stored is what was measured
    w_hat = dequantize_rotated(got)
    err = float((w - w_hat).double().pow(2).sum() / w.double().pow(2).sum())
    assert got.rel_error == pytest.approx(err, rel=1e-4, abs=1e-12)


@pytest.mark.parametrize("codebook", ["uniform", "lloyd-max"])
def test_native_fit_options(codebook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w = matrix("gaussian", (64, 256))
    for spec in (QuantSpec(bits=4, codebook=codebook, scale_iters=0, outliers=0.0),  # type: ignore[arg-type]
                 QuantSpec(bits=3, codebook=codebook, scale_iters=1),  # type: ignore[arg-type]
                 QuantSpec(bits=4, codebook=codebook, outliers=0.02)):  # type: ignore[arg-type]
        ref, got = _both(w, spec, monkeypatch)
        assert got.rel_error == pytest.approx(ref.rel_error, rel=2e-3)
        assert got.outlier_idx.numel() == ref.outlier_idx.numel()


def test_torch_only_options_still_run_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(fit, "fit_pass", lambda *a, **k: calls.append("native"))
    w = matrix("gaussian", (32, 256))
    rot = Rotation("none", 256, 128, 0)
    quantize_rotated(w, QuantSpec(bits=3, window_overlap=8), rot)
    quantize_rotated(w, QuantSpec(bits=3, temperature=4.0), rot)
    assert not calls


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_every_isa_gives_the_same_fit(isa: str, bits: int) -> None:
    _runs(isa)
    w = matrix("heavy", (64, 576), seed=3)
    cb = initial_codebook("lloyd-max", bits)
    outs = []
    for variant in ("scalar", isa):
        s = fit.init_scales(w, 128, NONE, False, variant)
        stats = fit.fit_pass(w, s, cb, 128, NONE, True, variant)
        o = fit.top_outliers(w, s, cb, 128, 40, variant)
        packed, vals, err, norm = fit.finish(w, s.half().float(), cb, 128, bits, o, variant)
        outs.append((s, stats, o, packed, vals, err, norm))
    (s0, st0, o0, p0, v0, e0, n0), (s1, st1, o1, p1, v1, e1, n1) = outs
    assert torch.allclose(s0, s1, rtol=1e-5) and torch.allclose(st0, st1, rtol=1e-5)
    assert torch.equal(o0, o1) and float((p0 == p1).float().mean()) > 0.999
    assert float((v0.float() - v1.float()).abs().max()) < 1e-2
    assert e0 == pytest.approx(e1, rel=1e-4) and n0 == pytest.approx(n1, rel=1e-6)


def test_results_do_not_depend_on_threads() -> None:
    w = matrix("heavy", (300, 576), seed=5)
    spec = QuantSpec(bits=3)
    rot = Rotation("none", 576, 128, 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantize_rotated(w, spec, rot)
        torch.set_num_threads(max(2, before))
        many = quantize_rotated(w, spec, rot)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.codes, many.codes) and torch.equal(one.scales, many.scales)
    assert torch.equal(one.codebook, many.codebook)
    assert torch.equal(one.outlier_idx, many.outlier_idx)
    assert torch.equal(one.outlier_val, many.outlier_val) and one.rel_error == many.rel_error


def test_outliers_are_the_exact_top_k() -> None:
    w = matrix("heavy", (120, 200), seed=1)
    cb = initial_codebook("lloyd-max", 3)
    s = fit.init_scales(w, 64, NONE, False)
    fit.fit_pass(w, s, cb, 64, NONE, True)
    k = outlier_count(w.numel(), 0.01)
    got = fit.top_outliers(w, s, cb, 64, k)
    # the same residuals in torch: groups of 64 columns, the last one 8 wide
    sx = s.repeat_interleave(64, dim=1)[:, :200]
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    resid = (w - cb[nearest(w / safe, cb)] * sx).abs().reshape(-1)
    want = torch.sort(torch.topk(resid, k).indices).values
    assert torch.equal(got, want)


def test_final_codes_are_packed_as_the_format_says() -> None:
    w = matrix("gaussian", (16, 200))
    for bits in (2, 3, 4, 8):
        cb = initial_codebook("lloyd-max", bits)
        s = fit.init_scales(w, 64, NONE, False).half().float()
        packed, vals, err, norm = fit.finish(w, s, cb, 64, bits, NONE)
        sx = s.repeat_interleave(64, dim=1)[:, :200]
        codes = nearest(w / sx, cb)
        assert torch.equal(packed, pack_codes(codes, bits))
        assert vals.numel() == 0
        assert norm == pytest.approx(float(w.double().pow(2).sum()), rel=1e-5)
        assert err == pytest.approx(float((w - cb[codes] * sx).double().pow(2).sum()), rel=1e-4)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize(("n", "block"), [(576, 128), (1536, 128), (200, 64), (72, 64),
                                          (13, 8), (8, 128), (4, 4)])
def test_inplace_rotation_is_the_reference_bit_for_bit(isa: str, n: int, block: int) -> None:
    _runs(isa)
    rot = make_rotation(RotationSpec(kind="hadamard", seed=n), n, block)
    assert rot.signs is not None
    w = torch.randn(37, n, generator=torch.Generator().manual_seed(n))
    want = hadamard_rotate(w, rot.signs, block)
    got = w.clone()
    assert fit.rotate_(got, rot.signs, block, isa) is got
    assert torch.equal(got, want)


def test_rotate_owned_falls_back_for_other_rotations() -> None:
    w = torch.randn(8, 64)
    rot = make_rotation(RotationSpec(kind="orthogonal"), 64, 32)
    got = quantizer.rotate_owned(w.clone(), rot)
    assert torch.allclose(got, rot.rotate_rows(w))


def test_scan_counts_what_the_pipeline_refuses() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 7e4, -7e4, 65504.0, 3.0])
    assert fit.scan(x) == (3, 2)
    assert fit.scan(torch.zeros(0)) == (0, 0)
    big = torch.zeros(300_001)
    big[-1] = float("nan")
    big[12345] = 1e5
    assert fit.scan(big) == (1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fit_matches_the_native_cpu_fit() -> None:
    """On a GPU the whole torch fit runs there (the weight moves once); same result."""
    w = matrix("heavy", (512, 1536), seed=2)
    rot = Rotation("none", 1536, 128, 0)
    for bits in (3, 4):
        cpu_q = quantize_rotated(w, QuantSpec(bits=bits), rot, "cpu")
        cuda_q = quantize_rotated(w, QuantSpec(bits=bits), rot, "cuda")
        assert cuda_q.codes.device.type == "cpu" and cuda_q.scales.device.type == "cpu"
        assert cuda_q.rel_error == pytest.approx(cpu_q.rel_error, rel=2e-3)
        assert float((cuda_q.codes == cpu_q.codes).float().mean()) > 0.99

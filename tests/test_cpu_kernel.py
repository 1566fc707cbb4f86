"""tq's native CPU kernel, every variant this CPU runs, against the torch reference.

Each SIMD variant is forced with `isa=` (the C++ side never runs one the CPU lacks, so a
variant above this CPU's is skipped, not silently replaced). Both regimes are covered:
the lookup-table GEMV (gemm_min_batch=0) and dequantize-then-GEMM (gemm_min_batch=1),
the latter with float32 products and with bf16 products (the default on CPUs with native
bf16 dot products; elsewhere "bf16" runs the float32 GEMM, which the same bound admits).
The comparison is with the reference in float32 on the same input values, so the
tolerance for bf16/fp16 activations is one rounding of the output, not the reference's
own intermediate roundings; bf16 products may also carry the rounding of both operands
and of the product to bf16 (3 x 2^-9 relative of |x_rot| @ |W|^T, bounded by 2^-7).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

from tq_cli.quant.grouped import QuantizedTensor, dequantize_rotated
from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_kernels import cpu, cpu_build, dispatch, reference

if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine (install g++ or set CXX): tq runs the torch "
                "reference on CPU", allow_module_level=True)

OUT = 40
RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


def _runs(isa: str) -> None:
    if cpu.ISAS.index(isa) > cpu.ISAS.index(cpu.cpu_isa()):
        pytest.skip(f"this CPU has no {isa} (best: {cpu.cpu_isa()})")


@functools.cache
def _quantized(bits: int, n: int, group: int) -> QuantizedTensor:
    g = torch.Generator().manual_seed(bits * 1000 + n + group)
    w = torch.randn(OUT, n, generator=g)
    return quantize(w, QuantSpec(bits=bits, group_size=group, outliers=0.004),
                    RotationSpec(kind="none"))


def _signs(n: int, block: int) -> torch.Tensor:
    rot = make_rotation(RotationSpec(kind="hadamard", seed=3), n, block)
    assert rot.signs is not None
    return rot.signs


def _want(x: torch.Tensor, q: QuantizedTensor, signs: torch.Tensor | None, block: int,
          bias: torch.Tensor | None) -> torch.Tensor:
    """The reference TQLinear forward in float32 on x's values."""
    xf = x.float()
    xr = reference.rotate(xf, signs, block) if signs is not None else xf
    y = reference.grouped_matmul(xr, q.codes, q.scales, q.codebook, bits=q.spec.bits,
                                 group_size=q.spec.group_size, out_features=OUT,
                                 in_features=x.shape[-1])
    y = reference.add_outliers(y, xr, q.outlier_idx, q.outlier_val, x.shape[-1])
    return y + bias.float() if bias is not None else y


def _bf16_rounding(x: torch.Tensor, q: QuantizedTensor, signs: torch.Tensor | None,
                   block: int) -> torch.Tensor:
    """|x_rot| @ |W|^T times 2^-7: the most that rounding both GEMM operands and the
    product to bf16 moves each output (3 x 2^-9 and the second-order terms)."""
    xf = x.float()
    xr = reference.rotate(xf, signs, block) if signs is not None else xf
    return 2.0**-7 * (xr.abs() @ dequantize_rotated(q).abs().T)


def _int8_parts(xr: torch.Tensor, codebook: torch.Tensor, group: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What csrc/int8_gemv.h multiplies, in float32 as it computes them: the activations
    rounded to int8 per group (scale max|x| / 127, to nearest even) and the levels rounded
    to int8 on the step max|level| / 127. Returns (q * scale per value [.., n], the
    levels' int8 values, the step)."""
    xf = xr.float()
    n = xf.shape[-1]
    out = torch.empty_like(xf, dtype=torch.float64)
    for c0 in range(0, n, group):
        part = xf[..., c0:c0 + group]
        m = part.abs().amax(-1, keepdim=True)
        inv = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
        q = torch.round(part * inv)  # float32 product, then round half to even
        out[..., c0:c0 + group] = q.double() * torch.where(m > 0, m / 127, 0).double()
    step = codebook.float().abs().max() / 127
    return out, torch.round(codebook.float() / step).clamp(-127, 127), step


def _int8_variant(isa: str, bits: int) -> bool:
    """Whether a one-row GEMV of that width named to run `isa` takes int8 products: asked
    for, and the variant has them (AVX2 on any CPU; AVX-512 where the process runs it and
    the CPU has VNNI, and VBMI at 2 and 3 bits; at 2-4 bits and 8 on an affine grid)."""
    return cpu.gemv_choice() == "int8" and cpu.native_int8_gemv(bits, isa)


def _int8_rounding(x: torch.Tensor, q: QuantizedTensor, signs: torch.Tensor | None,
                   block: int) -> torch.Tensor:
    """How far int8 products move each output: each activation by at most half its
    group's step (max|x| / 254), each level by half the levels' step, times the group
    scale; summed over |W| and |x_rot| (plus the step)."""
    xf = x.float()
    xr = reference.rotate(xf, signs, block) if signs is not None else xf
    group = q.spec.group_size
    half = torch.cat([xr[..., c0:c0 + group].abs().amax(-1, keepdim=True).expand(
        *xr.shape[:-1], min(group, xr.shape[-1] - c0)) for c0 in range(0, xr.shape[-1], group)],
        -1) / 254
    w = dequantize_rotated(q).abs()
    level = float(q.codebook.abs().max()) / 254
    dw = q.scales.float().abs().repeat_interleave(group, -1)[:, :xr.shape[-1]] * level
    return half @ w.T + (xr.abs() + half) @ dw.T + 2e-6 * (xr.abs() @ w.T)


def _same_on_one_and_two_threads(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """run() on one thread, checked equal bit for bit to run() on two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    return one


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
           slack: torch.Tensor | float = 0.0) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = float(want.abs().max())
    err = (got.float() - want).abs()
    bound = 2e-6 * scale + RTOL[dtype] * want.abs() + slack
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("isa", cpu.ISAS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("n", "group"), [(576, 64), (200, 64)])  # 200: a partial last group
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("path", "gemm"), [("gemv", "fp32"), ("gemv", "bf16"),
                                           ("gemm", "fp32"), ("gemm", "bf16")],
                         ids=["gemv32", "gemv16", "gemm32", "gemm16"])
def test_linear_matches_reference(isa: str, bits: int, n: int, group: int, batch: int,
                                  dtype: torch.dtype, path: str, gemm: str) -> None:
    """Float32 products: the reference to float32 accumulation order. bf16 products (the
    prefill GEMM, and the one-row GEMV of a 2-4-bit layer, bf16_gemv.h; float32 on a CPU
    without them): within the bound of rounding both operands and the product to bf16."""
    _runs(isa)
    q = _quantized(bits, n, group)
    g = torch.Generator().manual_seed(batch + n)
    x = torch.randn(batch, n, generator=g).to(dtype)
    bias = torch.randn(OUT, generator=g)
    signs = _signs(n, 64)
    got = cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                     q.outlier_val, bias, bits=bits, group_size=group, out_features=OUT,
                     isa=isa, gemm_min_batch=0 if path == "gemv" else 1, gemm=gemm)
    slack: torch.Tensor | float = 0.0
    int8 = batch == 1 and n % 64 == 0 and group % 64 == 0 and _int8_variant(isa, bits)
    if gemm == "bf16" and path == "gemv" and int8:
        slack = _int8_rounding(x, q, signs, 64)
    elif gemm == "bf16" and path == "gemv":
        slack = _bf16_rounding(x, q, signs, 64)
    elif gemm == "bf16":
        slack = _bf16_rounding(x, q, signs, 64)
        if dtype == torch.bfloat16:  # the bias goes inside the GEMM, as in bf16 F.linear
            slack = slack + 2.0**-8 * bias.abs()
    _check(got, _want(x, q, signs, 64, bias), dtype, slack)


@pytest.fixture
def bf16_gemv() -> Iterator[None]:
    """The one-row GEMV of 4-bit layers with bf16 products, as on a CPU without VNNI."""
    cpu.set_gemv_products("bf16")
    yield
    cpu.set_gemv_products(None)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [576, 1536])
def test_bf16_gemv_matches_an_emulation(bits: int, n: int, bf16_gemv: None) -> None:
    """A decode step's 2-4-bit GEMV with bf16 products is the float32 sum of bf16(x_rot) times
    the bf16-rounded levels, scaled per group, the outliers on the float32 x_rot: to float32
    accumulation, which the float32 GEMV (off by up to 2^-9 of each product) is not."""
    if not cpu.native_bf16_gemm():
        pytest.skip("this CPU has no bf16 dot products: 'bf16' runs float32 products")
    q = _quantized(bits, n, 64)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, generator=g)
    bias = torch.randn(OUT, generator=g)
    signs = _signs(n, 64)
    got = cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                     q.outlier_val, bias, bits=bits, group_size=64, out_features=OUT,
                     gemm_min_batch=0, gemm="bf16")
    xr = cpu.rotate(x, signs, 64)
    xb, cb = xr.bfloat16().double(), q.codebook.bfloat16().double()
    y = reference.grouped_matmul(xb, q.codes, q.scales.double(), cb, bits=bits, group_size=64,
                                 out_features=OUT, in_features=n)
    want = reference.add_outliers(y, xr.double(), q.outlier_idx, q.outlier_val.double(), n)
    want = want + bias.double()
    w = reference.grouped_matmul(xb.abs(), q.codes, q.scales.double().abs(), cb.abs(), bits=bits,
                                 group_size=64, out_features=OUT, in_features=n)
    err = (got.double() - want).abs()
    assert bool((err <= 1e-6 * w + 1e-6 * want.abs()).all()), float((err / w).max())
    fp32 = cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                      q.outlier_val, bias, bits=bits, group_size=64, out_features=OUT,
                      gemm_min_batch=0, gemm="fp32")
    assert not bool(((fp32.double() - want).abs() <= 1e-6 * w + 1e-6 * want.abs()).all())
    assert cpu.gemv_products(bits, 64, n) == "bf16"
    assert [cpu.gemv_products(*a) for a in ((4, 64, 200), (8, 64, n), (4, 32, n), (4, 64, n, 2))
            ] == ["fp32"] * 4


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(("n", "group"), [(576, 64), (576, 128), (1536, 128), (640, 256)])
def test_int8_gemv_matches_an_emulation(isa: str, bits: int, n: int, group: int) -> None:
    """A decode step's 2-4-bit GEMV with int8 products (csrc/int8_gemv.h, the default on
    AVX512-VNNI CPUs and in the AVX2 variant) is the float32 sum of the int8-rounded
    activations and levels, scaled per group, the outliers on the float32 x_rot: to
    float32 accumulation. With bf16 products asked for instead, the same call is not."""
    _runs(isa)
    if not _int8_variant(isa, bits):
        pytest.skip(f"the {isa} variant takes no int8 products at {bits} bits in this process")
    q = _quantized(bits, n, group)
    g = torch.Generator().manual_seed(n + group)
    x = torch.randn(1, n, generator=g)
    x[0, 5] = 9.0  # one large value: its group's step is 4x the others'
    bias = torch.randn(OUT, generator=g)
    signs = _signs(n, 64)

    def run() -> torch.Tensor:
        return cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                          q.outlier_val, bias, bits=bits, group_size=group,
                          out_features=OUT, isa=isa, gemm_min_batch=0, gemm="bf16")

    got = run()
    xr = cpu.rotate(x, signs, 64)
    xq, levels, step = _int8_parts(xr, q.codebook, group)
    args = {"bits": bits, "group_size": group, "out_features": OUT, "in_features": n}
    y = reference.grouped_matmul(xq, q.codes, q.scales.double(), levels.double() * float(step),
                                 **args)
    want = reference.add_outliers(y, xr.double(), q.outlier_idx, q.outlier_val.double(), n)
    want = want + bias.double()
    w = reference.grouped_matmul(xq.abs(), q.codes, q.scales.double().abs(),
                                 levels.double().abs() * float(step), **args)
    err = (got.double() - want).abs()
    assert bool((err <= 1e-6 * w + 1e-6 * want.abs()).all()), float((err / w).max())
    if isa == cpu.active_isa():
        assert cpu.gemv_products(bits, group, n) == "int8"
    exact = _want(x, q, signs, 64, bias).double()
    assert bool(((got.double() - exact).abs() <= _int8_rounding(x, q, signs, 64)).all())
    cpu.set_gemv_products("bf16")
    try:
        if isa == cpu.active_isa():
            assert cpu.gemv_products(bits, group, n) == (
                "bf16" if isa == "avx512" and cpu.native_bf16_gemm() else "fp32")
        assert not bool(((run().double() - want).abs() <= 1e-6 * w + 1e-6 * want.abs()).all())
    finally:
        cpu.set_gemv_products(None)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_int8_gemv_propagates_a_nan(isa: str) -> None:
    """A NaN or infinite activation gives NaN outputs, as float32 products would, instead
    of a scale that silently drops its group."""
    _runs(isa)
    if not _int8_variant(isa, 4):
        pytest.skip(f"the {isa} variant takes no int8 products in this process")
    q = _quantized(4, 576, 64)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 576)
        x[0, 100] = bad
        y = cpu.linear(x, None, 64, q.codes, q.scales, q.codebook, None, None, None, bits=4,
                       group_size=64, out_features=OUT, isa=isa, gemm_min_batch=0,
                       gemm="bf16")
        assert bool(y.isnan().all()), bad


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(("n", "group"), [(1152, 64), (4096, 2048)])
def test_int8_gemv_row_tails_group_blocks_and_threads(isa: str, bits: int, n: int,
                                                       group: int) -> None:
    """42 rows (two past the last 4-row pass), 18 groups (a second, partly masked block of
    16 group scales) or groups of 2048 (the largest the int8 GEMV takes, each lane's sum
    still exact in float32), on one thread and split over two (n=4096: 16-row tasks):
    equal to the emulation, and the split equal to one thread bit for bit."""
    _runs(isa)
    if not _int8_variant(isa, bits):
        pytest.skip(f"the {isa} variant takes no int8 products at {bits} bits in this process")
    out = 42
    g = torch.Generator().manual_seed(bits * n + group)
    q = quantize(torch.randn(out, n, generator=g), QuantSpec(bits=bits, group_size=group,
                                                             outliers=0.0),
                 RotationSpec(kind="none"))
    x = 3 * torch.randn(1, n, generator=g)

    def run() -> torch.Tensor:
        return cpu.linear(x, None, 0, q.codes, q.scales, q.codebook, None, None, None,
                          bits=bits, group_size=group, out_features=out, isa=isa,
                          gemm_min_batch=0, gemm="bf16")

    one = _same_on_one_and_two_threads(run)
    xq, levels, step = _int8_parts(x, q.codebook, group)
    args = {"bits": bits, "group_size": group, "out_features": out, "in_features": n}
    want = reference.grouped_matmul(xq, q.codes, q.scales.double(),
                                    levels.double() * float(step), **args)
    w = reference.grouped_matmul(xq.abs(), q.codes, q.scales.double().abs(),
                                 levels.double().abs() * float(step), **args)
    err = (one.double() - want).abs()
    assert bool((err <= 1e-6 * w + 1e-6 * want.abs()).all()), float((err / w).max())


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize(("n", "group"), [(576, 128), (896, 64), (4096, 2048)])
def test_int8_gemv_of_affine_8bit_levels(isa: str, n: int, group: int) -> None:
    """The one-row GEMV of 8-bit codes on an affine grid (the quantized head's levels
    k - 127.5 times a step; AVX2's vpmaddubsw, AVX512-VNNI's vpdpbusd) multiplies the
    codes themselves by the int8 activations: the float32 sum of the rounded activations
    times the exact levels, to float32 accumulation, on 42 rows (two past the last 4-row
    pass) and split over two threads bit for bit; codes 0 against activations of 127 (the
    largest pair sums, at the edge of vpmaddubsw's int16) do not saturate; a NaN gives
    NaN. With bf16 products asked for, the affine float32 GEMV runs instead."""
    _runs(isa)
    if not _int8_variant(isa, 8):
        pytest.skip(f"the {isa} variant takes no int8 products at 8 bits in this process")
    out = 42
    g = torch.Generator().manual_seed(n + group)
    codes = torch.randint(0, 256, (out, n), dtype=torch.uint8, generator=g)
    codes[0] = 0
    scales = (0.01 + 0.02 * torch.rand(out, -(-n // group), generator=g)).half()
    grid = (torch.arange(256, dtype=torch.float32) - 127.5) * 0.125
    x = 3 * torch.randn(1, n, generator=g)
    x[0, :group] = 2.0  # the first group all at 127 after rounding

    def run(v: torch.Tensor = x) -> torch.Tensor:
        return cpu.linear(v, None, 0, codes, scales, grid, None, None, None, bits=8,
                          group_size=group, out_features=out, isa=isa, gemm_min_batch=0,
                          gemm="bf16")

    one = _same_on_one_and_two_threads(run)
    xq, _, _ = _int8_parts(x, grid, group)
    weight = grid.double()[codes.long()] * scales.double().repeat_interleave(group, 1)[:, :n]
    want, w = xq @ weight.T, xq.abs() @ weight.abs().T  # in float64
    err = (one.double() - want).abs()
    assert bool((err <= 1e-6 * w + 1e-6 * want.abs()).all()), float((err / w).max())
    if isa == cpu.active_isa():
        assert cpu.gemv_products(8, group, n, affine=True) == "int8"
        assert cpu.gemv_products(8, group, n) == "fp32"  # levels not known to be affine
    bad = x.clone()
    bad[0, 7] = float("nan")
    assert bool(run(bad).isnan().all())
    exact = x.double() @ weight.T
    cpu.set_gemv_products("bf16")
    try:
        fp32 = run()
    finally:
        cpu.set_gemv_products(None)
    assert not torch.equal(fp32, one)
    _check(fp32, exact, torch.float32)


def test_gemv_products_follow_environment_and_setter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TQ_CPU_GEMV picks the GEMV's products, read once (so what `gemv_choice` says is what
    the kernel was told) until the setter, which wins over it; a mistyped value warns and
    keeps bf16, and an unknown one is refused by the setter."""
    try:
        for value, want in (("", "int8"), ("bf16", "bf16"), ("int8", "int8")):
            monkeypatch.setenv("TQ_CPU_GEMV", value)
            cpu.set_gemv_products(None)  # rereads the environment
            assert cpu.gemv_choice() == want, value
        monkeypatch.setenv("TQ_CPU_GEMV", "bf16")
        assert cpu.gemv_choice() == "int8"
        cpu.set_gemv_products("bf16")
        assert cpu.gemv_choice() == "bf16"
        monkeypatch.setenv("TQ_CPU_GEMV", "int4")
        with pytest.warns(RuntimeWarning, match="TQ_CPU_GEMV='int4' is not one of int8, bf16"):
            cpu.set_gemv_products(None)
        assert cpu.gemv_choice() == "bf16"
        with pytest.raises(ValueError, match="products must be one of int8, bf16, got 'fp8'"):
            cpu.set_gemv_products("fp8")
    finally:
        monkeypatch.undo()
        cpu.set_gemv_products(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_products_match_an_emulation(dtype: torch.dtype) -> None:
    """Where bf16 products run, each output is the bf16 product of the bf16-rounded rotated
    input and weight (outliers inside), rounded to bf16 once, the bias inside that rounding
    for bf16 activations and added in float32 after it otherwise: to one bf16 ulp, which
    pins the bias (dropped or added twice, it is off by far more)."""
    if not cpu.native_bf16_gemm():
        pytest.skip("this CPU has no bf16 dot products: 'bf16' runs float32 products")
    n = 576
    q = _quantized(4, n, 64)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(17, n, generator=g).to(dtype)
    bias = 4 * torch.randn(OUT, generator=g)
    signs = _signs(n, 64)
    got = cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                     q.outlier_val, bias, bits=4, group_size=64, out_features=OUT,
                     gemm_min_batch=1, gemm="bf16")
    xr = cpu.rotate(x.float(), signs, 64).bfloat16().double()  # the kernel's own rotation
    w = dequantize_rotated(q).bfloat16().double()
    p = xr @ w.T
    if dtype == torch.bfloat16:
        want = p + bias.bfloat16().double()
        bound = 2.0**-7 * want.abs()
    else:
        want = p + bias.double()
        bound = 2.0**-7 * p.abs() + RTOL[dtype] * want.abs()
    bound = bound + 1e-5 * (xr.abs() @ w.abs().T)  # float32 accumulation
    assert got.dtype == dtype
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_bf16_products_are_the_default_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill GEMM multiplies in bf16 where the CPU has bf16 dot products (and then
    differs from float32 products), and TQ_CPU_GEMM=fp32 turns that off."""
    monkeypatch.delenv("TQ_CPU_GEMM", raising=False)
    cpu.set_gemm_precision(None)
    q = _quantized(4, 576, 64)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(1))
    signs = _signs(576, 64)

    def run(gemm: str | None) -> torch.Tensor:
        return cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                          q.outlier_val, None, bits=4, group_size=64, out_features=OUT,
                          gemm=gemm)

    native = cpu.native_bf16_gemm()
    assert cpu.gemm_precision() == ("bf16" if native else "fp32")
    assert torch.equal(run(None), run(cpu.gemm_precision()))
    assert torch.equal(run("bf16"), run("fp32")) is not native
    with pytest.raises(ValueError, match="gemm must be one of fp32, bf16, got 'fp16'"):
        run("fp16")


def test_gemm_precision_follows_environment_and_setter(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    native = "bf16" if cpu.native_bf16_gemm() else "fp32"
    try:
        for value, want in (("fp32", "fp32"), ("Float32", "fp32"), ("bfloat16", native),
                            ("", native)):
            monkeypatch.setenv("TQ_CPU_GEMM", value)
            cpu.set_gemm_precision(None)  # rereads the environment
            assert cpu.gemm_precision() == want, value
        monkeypatch.setenv("TQ_CPU_GEMM", "fp32")
        cpu.set_gemm_precision("bf16")  # the setter wins over the environment
        assert cpu.gemm_precision() == native
        monkeypatch.setenv("TQ_CPU_GEMM", "fp32,")  # a mistyped opt-out still opts out
        cpu.set_gemm_precision(None)
        with pytest.warns(RuntimeWarning, match="TQ_CPU_GEMM='fp32,' is not one of fp32, "
                                                "bf16; using fp32"):
            assert cpu.gemm_precision() == "fp32"
        with pytest.raises(ValueError, match="precision must be one of fp32, bf16, got 'fp8'"):
            cpu.set_gemm_precision("fp8")
    finally:
        monkeypatch.undo()
        cpu.set_gemm_precision(None)


@pytest.mark.parametrize("isa", cpu.ISAS)
@pytest.mark.parametrize(("bits", "n", "group"), [(3, 200, 32), (4, 136, 24), (2, 96, 8),
                                                  (8, 72, 8), (4, 8, 8)])
@pytest.mark.parametrize("gemm", [False, True], ids=["gemv", "gemm"])
def test_odd_groups_and_widths(isa: str, bits: int, n: int, group: int, gemm: bool) -> None:
    """Groups that do not hold whole SIMD chunks run a narrower variant, still exact."""
    _runs(isa)
    q = _quantized(bits, n, group)
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    got = cpu.linear(x, None, 0, q.codes, q.scales, q.codebook, q.outlier_idx, q.outlier_val,
                     None, bits=bits, group_size=group, out_features=OUT, isa=isa,
                     gemm_min_batch=1 if gemm else 0, gemm="fp32")
    _check(got, _want(x, q, None, 0, None), torch.float32)


@pytest.mark.parametrize("isa", cpu.ISAS)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_one_row_against_every_row_count(isa: str, bits: int) -> None:
    """A decode step (one activation row) takes weight rows 4 at a time on AVX-512, then
    2, then 1: a row's sum is the same sequence of operations in each (so any count of
    rows gives every row the same value), and the reference's value."""
    _runs(isa)
    n, group = 200, 64
    q = _quantized(bits, n, group)
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(bits))

    def first(rows: int) -> torch.Tensor:
        keep = q.outlier_idx < rows * n
        return cpu.linear(x, None, 0, q.codes[:rows], q.scales[:rows], q.codebook,
                          q.outlier_idx[keep], q.outlier_val[keep], None, bits=bits,
                          group_size=group, out_features=rows, isa=isa, gemm_min_batch=0)

    every = first(OUT)
    for rows in (1, 2, 3, 5, 7):
        assert torch.equal(first(rows), every[:, :rows]), rows
    _check(every, _want(x, q, None, 0, None), torch.float32)


@pytest.mark.parametrize("isa", cpu.ISAS)
@pytest.mark.parametrize("gemm", [False, True], ids=["gemv", "gemm"])
def test_affine_8bit_levels_decode_without_the_table_exactly(isa: str, gemm: bool) -> None:
    """8-bit levels on an exact affine grid (k - 127.5, as the quantized lm_head stores
    them) are decoded by arithmetic, not looked up: the same result bit for bit as the
    lookup of the same levels (forced by changing a level no code uses, which breaks the
    grid), and the reference's."""
    _runs(isa)
    n, group = 200, 64
    q = _quantized(8, n, group)
    codes = q.codes.clamp(max=254)  # level 255 unused
    grid = torch.arange(256, dtype=torch.float32) - 127.5
    broken = grid.clone()
    broken[255] = 1e3
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(4))

    def run(levels: torch.Tensor) -> torch.Tensor:
        return cpu.linear(x, None, 0, codes, q.scales, levels, q.outlier_idx, q.outlier_val,
                          None, bits=8, group_size=group, out_features=OUT, isa=isa,
                          gemm_min_batch=1 if gemm else 0, gemm="fp32")

    got = run(grid)
    assert torch.equal(got, run(broken))
    want = reference.add_outliers(
        reference.grouped_matmul(x, codes, q.scales, grid, bits=8, group_size=group,
                                 out_features=OUT, in_features=n),
        x, q.outlier_idx, q.outlier_val, n)
    _check(got, want, torch.float32)


@pytest.mark.parametrize("isa", cpu.ISAS)
@pytest.mark.parametrize("gemm", [False, True], ids=["gemv", "gemm"])
@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_shared_input_is_rotated_once_and_never_stale(isa: str, gemm: bool, mode: str) -> None:
    """q/k/v read one input: the kernel reuses its rotation, but never across a change of
    weight width (layout), rotation, or an in-place write to x."""
    _runs(isa)
    n = 576
    q4, q3 = _quantized(4, n, 64), _quantized(3, n, 64)
    s64, s128 = _signs(n, 64), _signs(n, 128)
    ctx = torch.inference_mode() if mode == "inference" else torch.no_grad()
    with ctx:
        x = torch.randn(17, n, generator=torch.Generator().manual_seed(5))

        def run(q: QuantizedTensor, signs: torch.Tensor, block: int) -> None:
            got = cpu.linear(x, signs, block, q.codes, q.scales, q.codebook, q.outlier_idx,
                             q.outlier_val, None, bits=q.spec.bits, group_size=64,
                             out_features=OUT, isa=isa, gemm_min_batch=1 if gemm else 0,
                             gemm="fp32")
            _check(got, _want(x, q, signs, block, None), torch.float32)

        run(q4, s64, 64)
        run(q4, s64, 64)
        run(q3, s64, 64)      # another layout
        run(q3, s128, 128)    # another rotation
        x.mul_(-0.5)          # in place: same tensor, new values
        run(q3, s128, 128)
        x[3].zero_()
        run(q3, s128, 128)
        # Signs the kernel converts per call are a new tensor each time; one freed after a
        # call must not be mistaken for another allocated at the same address.
        other = _signs(n, 64) * torch.where(torch.arange(n) % 3 == 0, -1, 1).to(s64.dtype)
        for signs in (s64.float(), other.float(), s64.float(), other.float()):
            run(q4, signs, 64)
        # `.data =` keeps the TensorImpl and its version: new rows, then new values.
        x.data = torch.randn(40, n, generator=torch.Generator().manual_seed(6))
        run(q4, s64, 64)
        x.data = torch.randn(40, n, generator=torch.Generator().manual_seed(7))
        run(q4, s64, 64)


def test_large_inputs_are_not_kept() -> None:
    """Above 256 MiB of rotated activations the buffers are freed after the call (a long
    prefill of a wide layer); the next calls, on the same tensor too, are still exact."""
    n = 576
    q = _quantized(4, n, 64)
    signs = _signs(n, 64)
    x = torch.randn(60_000, n, generator=torch.Generator().manual_seed(9))  # 2 x 138 MB

    def run() -> torch.Tensor:
        return cpu.linear(x, signs, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                          q.outlier_val, None, bits=4, group_size=64, out_features=OUT,
                          gemm="fp32")

    want = _want(x, q, signs, 64, None)
    _check(run(), want, torch.float32)
    _check(run(), want, torch.float32)
    x[:7].mul_(3.0)
    _check(run(), _want(x, q, signs, 64, None), torch.float32)


def test_kernel_isa_follows_group_size() -> None:
    best = cpu.active_isa()
    assert cpu.kernel_isa(4, 128) == best
    assert cpu.kernel_isa(5, 128) == "scalar"  # no SIMD path for 5-bit codes
    assert cpu.kernel_isa(4, 8) == "scalar"
    if best == "avx512":
        assert cpu.kernel_isa(3, 32) == "avx2"  # a 64-code AVX-512 chunk straddles groups


@pytest.mark.parametrize(("n", "block"), [(576, 128), (200, 64), (96, 32), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_matches_reference(n: int, block: int, dtype: torch.dtype) -> None:
    signs = _signs(n, block)
    x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    got = cpu.rotate(x, signs, block)
    want = reference.rotate(x, signs, block)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 2.0**-8
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["prefix", "left_padding", "batch", "none", "all"])
def test_decode_attention_reads_only_the_unmasked_run(case: str) -> None:
    """One query token over a static cache: SDPA over the unmasked run of positions only,
    grouped heads read in place; the same as SDPA over the whole cache with the mask (to
    float rounding) for a prefix, left padding, rows of different lengths, no position
    unmasked and every position unmasked."""
    g = torch.Generator().manual_seed(1)
    b = 2 if case == "batch" else 1
    q = torch.randn(b, 6, 1, 32, generator=g)
    k, v = (torch.randn(b, 2, 64, 32, generator=g) for _ in range(2))
    mask = torch.zeros(b, 1, 1, 64, dtype=torch.bool)
    if case == "prefix":
        mask[..., :21] = True
    elif case == "left_padding":
        mask[..., 5:30] = True
    elif case == "batch":
        mask[0, ..., :40] = True
        mask[1, ..., 7:12] = True
    elif case == "all":
        mask[:] = True
    got = cpu.decode_attention(q, k, v, mask, 0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.3)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, atol=2e-6, equal_nan=True)
    with pytest.raises(RuntimeError, match="bool mask"):
        cpu.decode_attention(q, k, v, mask.float(), 0.3)


@pytest.mark.parametrize(("heads", "kv_heads", "d", "length", "batch"),
                         [(9, 3, 64, 160, 1), (4, 4, 128, 37, 2), (8, 2, 16, 3000, 1),
                          (2, 1, 64, 1, 1)])
def test_decode_attention_native_path_is_as_accurate_as_sdpa(heads: int, kv_heads: int, d: int,
                                                            length: int, batch: int) -> None:
    """float32 heads of a multiple of 16 (on AVX-512) run tq's own attention: against a
    float64 SDPA it is within 4x float32 SDPA's own error (its exp is a polynomial), with
    a hole and left padding in the mask, one query head per key/value head or several, and
    runs long enough to split over threads."""
    g = torch.Generator().manual_seed(length)
    q = torch.randn(batch, heads, 1, d, generator=g) * 2
    k, v = (torch.randn(batch, kv_heads, 4096, d, generator=g) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, 4096, dtype=torch.bool)
    mask[..., :length] = True
    if length > 2:
        mask[..., length // 2] = False
    if batch > 1:
        mask[1, ..., :2] = False

    def sdpa(*t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            *t, attn_mask=mask, scale=d**-0.5, enable_gqa=True)

    exact = sdpa(q.double(), k.double(), v.double())
    got = cpu.decode_attention(q, k, v, mask, d**-0.5)
    err, sdpa_err = ((t.double() - exact).abs().max().item() for t in (got, sdpa(q, k, v)))
    assert got.shape == (batch, heads, 1, d) and got.is_contiguous()
    assert err <= 4 * sdpa_err + 1e-7, (err, sdpa_err)


def test_decode_attention_other_heads_are_sdpa_bit_for_bit() -> None:
    """Heads the native path does not take (24 wide; bfloat16) are SDPA over the run."""
    g = torch.Generator().manual_seed(3)
    for d, dtype in ((24, torch.float32), (64, torch.bfloat16)):
        q = torch.randn(1, 4, 1, d, generator=g).to(dtype)
        k, v = (torch.randn(1, 2, 64, d, generator=g).to(dtype) for _ in range(2))
        mask = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
        mask[..., :20] = True
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, :20], v[:, :, :20], scale=0.2, enable_gqa=True)
        assert torch.equal(cpu.decode_attention(q, k, v, mask, 0.2), want)


def test_outliers_are_added_exactly() -> None:
    """A zero codebook leaves only the outliers: y must be exactly x @ S.T + bias."""
    n, out = 24, 3
    codes = torch.zeros(out, n // 2, dtype=torch.uint8)
    scales = torch.ones(out, 1, dtype=torch.float16)
    idx = torch.tensor([0, 23, 24 + 5, 2 * 24 + 23], dtype=torch.int32)
    val = torch.tensor([0.5, -2.0, 4.0, 0.25], dtype=torch.float16)
    x = torch.arange(2 * n, dtype=torch.float32).reshape(2, n)
    bias = torch.tensor([1.0, 2.0, 3.0])
    for isa in cpu.ISAS[: cpu.ISAS.index(cpu.cpu_isa()) + 1]:
        for gmb, gemm in ((0, None), (1, "fp32"), (1, "bf16")):  # all exact in bf16 too
            y = cpu.linear(x, None, 0, codes, scales, torch.zeros(16), idx, val, bias, bits=4,
                           group_size=24, out_features=out, isa=isa, gemm_min_batch=gmb,
                           gemm=gemm)
            want = torch.tensor([[0.5 * 0 - 2 * 23 + 1, 4.0 * 5 + 2, 0.25 * 23 + 3],
                                 [0.5 * 24 - 2 * 47 + 1, 4.0 * 29 + 2, 0.25 * 47 + 3]])
            assert torch.equal(y, want), (isa, gmb, gemm, y)


def test_unsorted_outliers_are_refused() -> None:
    q = _quantized(4, 200, 64)
    idx = q.outlier_idx.flip(0)
    with pytest.raises(RuntimeError, match="strictly ascending"):
        cpu.linear(torch.randn(1, 200), None, 0, q.codes, q.scales, q.codebook, idx,
                   q.outlier_val, None, bits=4, group_size=64, out_features=OUT)


def test_leading_dims_and_orthogonal_rotation_through_dispatch() -> None:
    n = 200
    q = _quantized(4, n, 64)
    rot = make_rotation(RotationSpec(kind="orthogonal", seed=2), n, 64)
    material = (rot.matrix, rot.tail)
    x = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(9))
    kw = {"bits": 4, "group_size": 64, "out_features": OUT, "in_features": n}
    got = dispatch.linear(x, material, 64, q.codes, q.scales, q.codebook, q.outlier_idx,
                          q.outlier_val, None, **kw)
    xr = reference.rotate(x, material, 64)
    want = reference.add_outliers(
        reference.grouped_matmul(xr, q.codes, q.scales, q.codebook, **kw), xr, q.outlier_idx,
        q.outlier_val, n)
    assert got.shape == (2, 3, OUT)
    assert torch.allclose(got, want, atol=2e-6 * float(want.abs().max()), rtol=0)


def test_force_reference_and_gradients_take_the_reference(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    assert dispatch.backend_for("cpu", 4, 128) == f"cpu-{cpu.kernel_isa(4, 128)}"
    monkeypatch.setenv("TQ_FORCE_REFERENCE", "1")
    assert dispatch.backend_for("cpu", 4, 128) == "torch"
    monkeypatch.delenv("TQ_FORCE_REFERENCE")
    q = _quantized(4, 200, 64)
    x = torch.randn(2, 200, requires_grad=True)
    y = dispatch.linear(x, None, 0, q.codes, q.scales, q.codebook, q.outlier_idx,
                        q.outlier_val, None, bits=4, group_size=64, out_features=OUT,
                        in_features=200)
    y.sum().backward()  # the native op has no gradient: the reference ran
    assert x.grad is not None


def test_failed_build_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: object) -> None:
    monkeypatch.setenv("TQ_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    built = cpu_build.load()  # never raises
    assert built.path is None and built.error
    monkeypatch.setattr(cpu_build, "load", lambda: built)
    monkeypatch.setattr(cpu_build, "_announced", set())
    cpu._built.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not cpu.available() and not cpu.available()
            assert dispatch.backend_for("cpu") == "torch"
        assert len(caught) == 1 and "runs the torch reference" in str(caught[0].message)
        assert "Fix: install a C++ compiler" in str(caught[0].message)
    finally:
        monkeypatch.undo()
        cpu._built.cache_clear()
    assert cpu.available()


_CAPPED = """
import torch
from tq_kernels import cpu, fit, kv
q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
m = torch.ones(1, 1, 1, 9, dtype=torch.bool)
sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
same = torch.equal(cpu.decode_attention(q, k, v, m, 0.125), sdpa)
print(cpu.active_isa(), fit.active_isa(), kv.active_isa(), cpu.native_bf16_gemm(), same)
"""


@pytest.mark.parametrize(("cap", "isa"), [("avx2", "avx2"), ("portable", "scalar"),
                                          ("scalar", "scalar")])
def test_tq_cpu_isa_makes_a_narrower_cpu(cap: str, isa: str) -> None:
    """TQ_CPU_ISA runs what a CPU of that width runs, in every library and in the operators
    that pick a variant themselves: decode attention takes SDPA (bit for bit) instead of the
    AVX-512 loop, and no bf16 GEMM products (a CPU without AVX-512 has none)."""
    import os
    import subprocess
    import sys

    _runs(isa)
    env = {**os.environ, "TQ_CPU_ISA": cap}
    out = subprocess.run([sys.executable, "-c", _CAPPED], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [isa, isa, isa, "False", "True"]


def test_the_queries_load_the_library_first() -> None:
    """A fresh process may ask which products or variant a layer takes before any kernel
    ran: each query loads the library before it looks up its operator."""
    import subprocess
    import sys

    for query in ("cpu.gemv_products(4, 128, 4096)", "cpu.native_int8_gemv(3)",
                  "cpu.kernel_isa(4, 128)"):
        code = f"from tq_kernels import cpu; print({query})"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, (query, out.stderr[-500:])

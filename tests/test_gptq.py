import itertools
import math
import random

import pytest
import torch

import tq_cli.conversion.mixed_precision as alloc
from tq_cli.conversion.mixed_precision import AllocationError, allocate
from tq_cli.errors import TqError
from tq_cli.io.format import storage_layout, stored_tensors
from tq_cli.quant.gptq import (
    CalibrationUnusableError,
    quantize_calibrated,
    relative_weighted_error,
    rotate_hessian,
    weighted_error,
)
from tq_cli.quant.grouped import dequantize_rotated, quantize_rotated
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec


def low_rank_hessian(n: int, rank: int, seed: int) -> torch.Tensor:
    """H = A A^T + small diag: activations living in a few directions, as after a norm."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, rank, generator=g, dtype=torch.float64)
    a = a * (torch.rand(rank, generator=g, dtype=torch.float64) * 3)
    return a @ a.T + 1e-2 * torch.eye(n, dtype=torch.float64)


def correlated_hessian(n: int, seed: int) -> torch.Tensor:
    """Full rank, neighbouring channels 0.9 correlated, channel scales 0.1 .. 3.1."""
    i = torch.arange(n, dtype=torch.float64)
    s = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    s = s + 0.1
    return 0.9 ** (i[:, None] - i[None, :]).abs() * s[:, None] * s[None, :]


def setup(n: int = 256, kind: str = "hadamard", group: int = 64, seed: int = 0,
          h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Rotation]:
    w = torch.randn(64, n, generator=torch.Generator().manual_seed(seed))
    rot = make_rotation(RotationSpec(kind=kind), n, group)
    h = low_rank_hessian(n, 16, seed + 1) if h is None else h
    return rot.rotate_rows(w), rotate_hessian(h, rot), rot


def data_free_error(w_rot: torch.Tensor, h_rot: torch.Tensor, spec: QuantSpec,
                    rot: Rotation) -> float:
    return relative_weighted_error(w_rot, dequantize_rotated(quantize_rotated(w_rot, spec, rot)),
                                   h_rot)


@pytest.mark.parametrize("kind,n", [("hadamard", 96), ("orthogonal", 200), ("none", 64)])
def test_rotate_hessian_keeps_weighted_error(kind: str, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, 3 * n, generator=g, dtype=torch.float64)
    h = a @ a.T
    dw = torch.randn(8, n, generator=g)
    rot = make_rotation(RotationSpec(kind=kind), n, 64)
    h_rot = rotate_hessian(h, rot)
    assert h_rot.dtype == torch.float64
    assert torch.allclose(h_rot, h_rot.T, atol=1e-9 * float(h.abs().max()))
    zero = torch.zeros_like(dw)
    direct = float(torch.einsum("ri,ij,rj->", dw.double(), h, dw.double()))
    assert weighted_error(dw, zero, h) == pytest.approx(direct, rel=1e-9)
    assert weighted_error(rot.rotate_rows(dw), zero, h_rot) == pytest.approx(direct, rel=1e-5)


def test_weighted_error_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import tq_cli.quant.gptq as gptq

    w, h_rot, _ = setup(n=128)
    w_hat = w + 0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    whole = weighted_error(w, w_hat, h_rot)
    monkeypatch.setattr(gptq, "CHUNK_ELEMENTS", 300)  # two rows per chunk
    assert weighted_error(w, w_hat, h_rot) == pytest.approx(whole, rel=1e-12)
    d = (w - w_hat).double()
    ref = float(torch.trace(d @ h_rot @ d.T) / torch.trace(w.double() @ h_rot @ w.double().T))
    assert relative_weighted_error(w, w_hat, h_rot) == pytest.approx(ref, rel=1e-9)
    assert relative_weighted_error(torch.zeros(2, 128), torch.zeros(2, 128), h_rot) == 0.0


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("hessian", ["low-rank", "correlated"])
def test_calibrated_beats_data_free(bits: int, hessian: str) -> None:
    h = low_rank_hessian(256, 16, 1) if hessian == "low-rank" else correlated_hessian(256, 1)
    w_rot, h_rot, rot = setup(h=h)
    spec = QuantSpec(bits=bits, group_size=64)
    q = quantize_calibrated(w_rot, h_rot, spec, rot)
    calibrated = relative_weighted_error(w_rot, dequantize_rotated(q), h_rot)
    # Measured ratios: about 0.02 (low rank) and 0.2 (correlated).
    assert calibrated < 0.4 * data_free_error(w_rot, h_rot, spec, rot)


@pytest.mark.parametrize("bits", [2, 3])
def test_act_order_beats_data_free(bits: int) -> None:
    w_rot, h_rot, rot = setup(h=correlated_hessian(256, 2), kind="orthogonal", group=128)
    spec = QuantSpec(bits=bits, group_size=128)
    q = quantize_calibrated(w_rot, h_rot, spec, rot, act_order=True)
    assert relative_weighted_error(w_rot, dequantize_rotated(q), h_rot) < \
        0.4 * data_free_error(w_rot, h_rot, spec, rot)
    assert q.scales.shape == (64, 2)


@pytest.mark.parametrize("bits", [2, 4])
def test_identity_hessian_matches_data_free(bits: int) -> None:
    w_rot, _, rot = setup()
    spec = QuantSpec(bits=bits, group_size=64)
    base = quantize_rotated(w_rot, spec, rot)
    q = quantize_calibrated(w_rot, torch.eye(256, dtype=torch.float64), spec, rot)
    # No correlation: no error to feed forward, so GPTQ is nearest-level on the same grid.
    assert q.rel_error == pytest.approx(base.rel_error, rel=0.02)
    # Mostly the same outliers (the data-free fit picks them before its last refinements).
    same = set(q.outlier_idx.tolist()) & set(base.outlier_idx.tolist())
    assert len(same) >= 0.7 * base.outlier_idx.numel()


@pytest.mark.parametrize("act_order", [False, True])
def test_format_matches_data_free(act_order: bool) -> None:
    w_rot, h_rot, rot = setup(n=200, kind="orthogonal")  # a partial last group
    spec = QuantSpec(bits=3, group_size=64, outliers=0.01)
    q = quantize_calibrated(w_rot, h_rot, spec, rot, act_order=act_order, block_size=32)
    layout = storage_layout(64, 200, spec)
    dtypes = {"U8": torch.uint8, "F16": torch.float16, "F32": torch.float32,
              "I32": torch.int32}
    for suffix, t in stored_tensors("w", q).items():
        dtype, shape = layout[suffix.split(".", 1)[1]]
        assert t.dtype == dtypes[dtype] and list(t.shape) == shape, suffix
    idx = q.outlier_idx.long()
    assert idx.numel() == 128 and bool((idx[1:] > idx[:-1]).all())
    assert int(idx[0]) >= 0 and int(idx[-1]) < 64 * 200
    w_hat = dequantize_rotated(q)
    assert q.rel_error == pytest.approx(float((w_rot - w_hat).pow(2).sum() / w_rot.pow(2).sum()),
                                        rel=1e-5)
    assert bool((q.codebook[1:] > q.codebook[:-1]).all())


def test_outliers_lower_the_weighted_error() -> None:
    w_rot, h_rot, rot = setup()
    w_rot[5, 7] = 40.0
    errs = {}
    for frac in (0.0, 0.01):
        q = quantize_calibrated(w_rot, h_rot, QuantSpec(bits=2, group_size=64, outliers=frac), rot)
        errs[frac] = relative_weighted_error(w_rot, dequantize_rotated(q), h_rot)
    assert errs[0.01] < 0.9 * errs[0.0]
    # Without correlation nothing is fed forward: an outlier is kept exactly (to fp16).
    spec = QuantSpec(bits=2, group_size=64, outliers=0.01)
    q = quantize_calibrated(w_rot, torch.eye(256, dtype=torch.float64), spec, rot)
    assert 5 * 256 + 7 in q.outlier_idx.tolist()
    assert dequantize_rotated(q)[5, 7].item() == pytest.approx(40.0, abs=0.02)


def test_dead_and_singular_hessians_work() -> None:
    h = low_rank_hessian(128, 4, 3)
    h[:, 10:20] = 0
    h[10:20, :] = 0  # inputs no token touched
    w_rot, h_rot, rot = setup(n=128, kind="none", h=h)
    spec = QuantSpec(bits=3, group_size=64)
    for damp in (0.01, 0.0):  # 0: the singular H needs the damping raised
        q = quantize_calibrated(w_rot, h_rot, spec, rot, damp=damp)
        w_hat = dequantize_rotated(q)
        assert bool(torch.isfinite(w_hat).all())
        assert relative_weighted_error(w_rot, w_hat, h_rot) < \
            0.4 * data_free_error(w_rot, h_rot, spec, rot)
        assert (w_hat - w_rot)[:, 10:20].abs().max() < 2.0  # dead columns still quantized


@pytest.mark.parametrize("case,needle", [
    ("zeros", "all zeros"), ("nan", "non-finite"), ("inf", "non-finite"),
    ("negative", "negative diagonal"), ("indefinite", "Cholesky failed"),
])
def test_unusable_hessian_raises(case: str, needle: str) -> None:
    w_rot, _, rot = setup(n=64, kind="none")
    h = torch.eye(64, dtype=torch.float64)
    if case == "zeros":
        h.zero_()
    elif case == "nan":
        h[3, 4] = math.nan
    elif case == "inf":
        h[0, 0] = math.inf
    elif case == "negative":
        h[2, 2] = -1.0
    else:
        h = torch.full((64, 64), -0.9, dtype=torch.float64).fill_diagonal_(1.0)
    with pytest.raises(CalibrationUnusableError, match=needle) as info:
        quantize_calibrated(w_rot, h, QuantSpec(bits=3, group_size=64), rot)
    assert isinstance(info.value, TqError)


def test_wrong_hessian_shape_is_a_value_error() -> None:
    w_rot, _, rot = setup(n=64, kind="none")
    with pytest.raises(ValueError, match=r"\(64, 64\)"):
        quantize_calibrated(w_rot, torch.eye(32), QuantSpec(bits=3, group_size=64), rot)


# --- bit allocation -------------------------------------------------------------------

def random_problem(rng: random.Random, tensors: int, widths: tuple[int, ...]
                   ) -> tuple[dict[str, dict[int, tuple[float, int]]], dict[str, int]]:
    """Sizes and importances spread wide, as between attention and MLP projections."""
    options, numel = {}, {}
    for t in range(tensors):
        n = rng.choice([64, 256, 1024, 4096]) * rng.randint(1, 8)
        imp = rng.lognormvariate(0, 1.5)
        numel[f"t{t}"] = n
        options[f"t{t}"] = {b: (imp * n * 4.0 ** -b * rng.uniform(0.7, 1.3),
                                n * b + rng.randint(0, n // 4) + 16 * (1 << b)) for b in widths}
    return options, numel


def brute_force(options: dict[str, dict[int, tuple[float, int]]], budget: float) -> float:
    names = sorted(options)
    best = math.inf
    for combo in itertools.product(*(sorted(options[n]) for n in names)):
        if sum(options[n][b][1] for n, b in zip(names, combo, strict=True)) <= budget:
            best = min(best, sum(options[n][b][0] for n, b in zip(names, combo, strict=True)))
    return best


def test_allocation_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(60):
        widths = rng.choice([(2, 3, 4), (2, 3, 4, 8), (2, 4)])
        options, numel = random_problem(rng, rng.randint(2, 6), widths)
        total = sum(numel.values())
        lo = sum(min(c for _, c in o.values()) for o in options.values()) / total
        target = rng.uniform(lo, max(widths) + 0.5)
        a = allocate(options, target, numel)
        assert a.storage_bits <= target * total
        assert a.bpw == pytest.approx(a.storage_bits / total)
        assert a.error == pytest.approx(brute_force(options, target * total), rel=1e-9)


def test_sweep_path_is_close_on_many_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    options, numel = {}, {}
    rng = random.Random(1)
    for layer in range(12):
        for name, n in (("attn", 576 * 576), ("up", 1536 * 576), ("down", 1536 * 576)):
            imp = rng.lognormvariate(0, 0.7)
            numel[f"{layer:02d}.{name}"] = n
            options[f"{layer:02d}.{name}"] = {b: (imp * n * 4.0 ** -b, n * b + n // 32)
                                              for b in (2, 3, 4, 8)}
    total = sum(numel.values())
    for target in (2.6, 3.3, 4.2):
        exact = allocate(options, target, numel)
        monkeypatch.setattr(alloc, "MAX_STATES", 1)  # force the Lagrangian sweep + repair
        swept = allocate(options, target, numel)
        monkeypatch.undo()
        assert swept.storage_bits <= target * total
        assert swept.error <= exact.error * 1.01


def test_allocation_ties_go_to_the_first_name() -> None:
    same = {2: (10.0, 200), 4: (1.0, 400)}
    options = {"b": dict(same), "a": dict(same), "c": dict(same)}
    numel = {"a": 100, "b": 100, "c": 100}
    assert allocate(options, 8 / 3, numel).bits == {"a": 4, "b": 2, "c": 2}
    assert allocate(options, 8 / 3, numel).bpw == pytest.approx(8 / 3)


def test_allocation_skips_dominated_widths() -> None:
    options = {"x": {2: (5.0, 200), 3: (6.0, 300), 4: (1.0, 400)}}
    assert allocate(options, 3.5, {"x": 100}).bits == {"x": 2}
    assert allocate(options, 4.0, {"x": 100}).bits == {"x": 4}


def test_allocation_errors_say_what_is_wrong() -> None:
    options = {"x": {2: (5.0, 250), 4: (1.0, 450)}}
    with pytest.raises(AllocationError, match=r"below the smallest achievable 2\.5000 bpw"):
        allocate(options, 2.4, {"x": 100})
    with pytest.raises(AllocationError, match="only one of"):
        allocate(options, 3.0, {"y": 100})
    with pytest.raises(AllocationError, match="finite"):
        allocate({"x": {2: (math.nan, 250)}}, 3.0, {"x": 100})
    with pytest.raises(AllocationError, match="positive integer"):
        allocate({"x": {2: (1.0, 0)}}, 3.0, {"x": 100})
    with pytest.raises(AllocationError, match="no width"):
        allocate({"x": {}}, 3.0, {"x": 100})


@pytest.mark.parametrize("kind,n", [("hadamard", 200), ("orthogonal", 200)])
def test_rotate_hessian_in_place_is_r_t_h_r(kind: str, n: int) -> None:
    """In place, a block of rows then a block of columns at a time: R^T H R as the dense
    product computes it (R from rotating the identity's rows)."""
    from tq_cli.quant.gptq import rotate_hessian_

    h = low_rank_hessian(n, 20, 3)
    rot = make_rotation(RotationSpec(kind=kind, seed=4), n, 64)
    r = rot.rotate(torch.eye(n, dtype=torch.float64))
    want = r.T @ h @ r
    got = rotate_hessian_(h.clone(), rot, chunk_elements=7 * n)  # 7-row / 7-column chunks
    assert torch.allclose(got, want, atol=1e-10 * float(h.abs().max()))


def test_inverse_factor_leaves_h_as_it_came() -> None:
    """U with U^T U = (H + damp mean(diag) I)^-1, upper triangular; H untouched."""
    from tq_cli.quant.factor import _inverse_cholesky

    h = correlated_hessian(96, 1)
    before = h.clone()
    up = _inverse_cholesky(h, 0.01)
    assert torch.equal(h, before) and torch.equal(up, up.triu())
    damped = h + 0.01 * float(torch.diagonal(h).mean()) * torch.eye(96, dtype=torch.float64)
    want = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert torch.allclose(up.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("outliers", [0.0, 0.01])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_fit_reports_the_weighted_error_of_what_it_stores(bits: int, outliers: float,
                                                             dtype: torch.dtype) -> None:
    """The weighted error the refit computes from its own products equals tr(dW H dW^T)
    and its ratio to tr(W H W^T) measured from scratch (float64) on the stored tensor, for
    H in float64 and in float32 (the conversion's precision), 8 bits included (an error
    1e-5 of the norm, which an expansion of the square would lose in float32)."""
    from tq_cli.quant.gptq import fit_calibrated, weighted_errors

    w_rot, h_rot, rot = setup(n=200, group=64, h=correlated_hessian(200, 2))
    fit = fit_calibrated(w_rot, h_rot.to(dtype),
                         QuantSpec(bits=bits, group_size=64, outliers=outliers), rot)
    assert fit.q.outlier_idx.numel() == (0 if outliers == 0 else 128)
    num, rel = weighted_errors(w_rot, dequantize_rotated(fit.q), h_rot)
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert fit.weighted_error == pytest.approx(num, rel=tol)
    assert fit.relative_weighted_error == pytest.approx(rel, rel=tol)


def test_a_float32_hessian_fits_as_well_as_float64() -> None:
    """The conversion's float32 Hessian work (the GPTQ reference's precision) gives the
    float64 fit's weighted error within 0.5% on an ill-conditioned H (channel scales 0.1 to
    3.1, neighbours 0.9 correlated), at 2, 3 and 4 bits."""
    from tq_cli.quant.gptq import fit_calibrated

    w_rot, h_rot, rot = setup(n=256, group=64, h=correlated_hessian(256, 5))
    for bits in (2, 3, 4):
        spec = QuantSpec(bits=bits, group_size=64)
        e64 = fit_calibrated(w_rot, h_rot, spec, rot).relative_weighted_error
        e32 = fit_calibrated(w_rot, h_rot.float(), spec, rot).relative_weighted_error
        assert e32 == pytest.approx(e64, rel=5e-3), bits


def test_inverse_factor_raises_the_damping_where_it_must() -> None:
    """An H with an eigenvalue of -5% of its mean diagonal fails Cholesky at 1% damping and
    succeeds at 10%: the factor is that of (H + 0.1 mean(diag) I)^-1; H untouched."""
    from tq_cli.quant.factor import _inverse_cholesky

    g = torch.Generator().manual_seed(7)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    lam = torch.linspace(1.0, 2.0, 64, dtype=torch.float64)
    lam[0] = -0.05 * float(lam.mean())
    h = q @ torch.diag(lam) @ q.T
    h = (h + h.T) / 2
    before = h.clone()
    up = _inverse_cholesky(h, 0.01)
    assert torch.equal(h, before)
    damped = h + 0.1 * float(torch.diagonal(h).mean()) * torch.eye(64, dtype=torch.float64)
    want = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert torch.allclose(up.double(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_reverse_in_place_is_flip_of_both_dimensions() -> None:
    from tq_cli.quant.factor import _reverse_

    for n in (1, 2, 3, 7, 64, 129):
        x = torch.randn(n, n)
        for chunk in (1, 3, 1 << 20):
            y = x.clone()
            ptr = y.data_ptr()
            assert torch.equal(_reverse_(y, chunk), x.flip(0, 1)) and y.data_ptr() == ptr


def test_transpose_in_place_and_the_in_place_factor() -> None:
    from tq_cli.quant.factor import _transpose_

    for n in (1, 5, 64, 130):
        x = torch.randn(n, n)
        for block in (1, 7, 1024):
            y = x.clone()
            assert torch.equal(_transpose_(y, block), x.T)
    # potrf on the column-major view gives torch's own factor: bit for bit where MKL
    # takes one kernel for both layouts, a few float32 ulps apart where it does not (an
    # Intel CPU with MKL capped at AVX2: 2-3e-7 on entries up to 1.1)
    a = torch.randn(300, 200)
    h = a @ a.T / 200 + 0.1 * torch.eye(300)
    low = h.clone()
    low_t = low.T
    torch.linalg.cholesky_ex(low_t, out=(low_t, torch.zeros((), dtype=torch.int32)))
    torch.testing.assert_close(_transpose_(low), torch.linalg.cholesky(h), rtol=0, atol=2e-6)

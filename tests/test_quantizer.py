import itertools

import pytest
import torch

from tq_cli.quant.codebook import lloyd_max_gaussian
from tq_cli.quant.grouped import dequantize, dequantize_rotated, outlier_count
from tq_cli.quant.prepare import quantize
from tq_cli.quant.spec import QuantSpec, RotationSpec

# Lloyd-Max MSE for N(0,1) at 2, 3, 4 bits (Max 1960).
OPTIMUM = {2: 0.1175, 3: 0.03454, 4: 0.009497}


def rel(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w - w_hat).pow(2).sum() / w.pow(2).sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_table(bits: int) -> None:
    assert lloyd_max_gaussian(1 << bits)[1] == pytest.approx(OPTIMUM[bits], rel=1e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_error_near_lloyd_max_optimum(bits: int) -> None:
    w = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
    q = quantize(w, QuantSpec(bits=bits), RotationSpec(kind="hadamard"))
    err = rel(w, dequantize(q))
    assert err <= 1.10 * OPTIMUM[bits]
    assert q.rel_error == pytest.approx(err, rel=1e-3)


def test_rotation_helps_on_heavy_tailed_weights() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((256, 512))
    w = w * (torch.rand(512, generator=g) * 4)  # uneven column scales, as in real LLMs
    base = quantize(w, QuantSpec(bits=3), RotationSpec(kind="none")).rel_error
    for kind in ("hadamard", "orthogonal"):
        rotated = quantize(w, QuantSpec(bits=3), RotationSpec(kind=kind)).rel_error  # type: ignore[arg-type]
        assert rotated < 0.8 * base


@pytest.mark.parametrize("n", [96, 200, 576])
def test_awkward_widths_round_trip_shapes(n: int) -> None:
    w = torch.randn(40, n)
    q = quantize(w, QuantSpec(bits=4, group_size=64), RotationSpec(kind="hadamard"))
    assert q.scales.shape == (40, -(-n // 64))
    assert dequantize(q).shape == (40, n)
    assert rel(w, dequantize(q)) < 0.02


def test_refinement_never_hurts() -> None:
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    errs = [quantize(w, QuantSpec(bits=3, scale_iters=i, outliers=0)).rel_error
            for i in (0, 1, 2, 4)]
    assert all(b <= a + 1e-7 for a, b in itertools.pairwise(errs))


def test_outliers_are_kept_exactly() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    w[5, 7] = 40.0
    q = quantize(w, QuantSpec(bits=2, outliers=0.01), RotationSpec(kind="none"))
    assert q.outlier_idx.numel() == outlier_count(w.numel(), 0.01)
    assert 5 * 128 + 7 in q.outlier_idx.tolist()
    assert dequantize_rotated(q)[5, 7].item() == pytest.approx(40.0, abs=0.02)


def test_zero_matrix_is_exact() -> None:
    q = quantize(torch.zeros(16, 64), QuantSpec(bits=3))
    assert torch.equal(dequantize(q), torch.zeros(16, 64))
    assert q.rel_error == 0.0


def test_uniform_without_refinement_is_round_to_nearest() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    q = quantize(w, QuantSpec(bits=4, codebook="uniform", scale_iters=0, outliers=0,
                              group_size=64), RotationSpec(kind="none"))
    absmax = w.abs().amax(dim=1, keepdim=True).half().float()
    step = 2 / 15
    ref = (torch.round((w / absmax + 1) / step) * step - 1).clamp(-1, 1) * absmax
    assert torch.allclose(dequantize(q), ref, atol=1e-6)


def test_options_have_their_stated_effect() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    plain = quantize(w, QuantSpec(bits=3))
    window = quantize(w, QuantSpec(bits=3, window_overlap=16))
    soft = quantize(w, QuantSpec(bits=3, temperature="auto"))
    # Both change the fit (they are real options), and both stay sane.
    assert not torch.equal(window.scales, plain.scales)
    assert not torch.equal(soft.codebook, plain.codebook)
    assert window.rel_error < 0.05 and soft.rel_error < 0.05


def test_dequantize_in_row_blocks_is_the_whole_dequantization(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows a block at a time (7-row blocks here) give the one-shot dequantization bit for
    bit, outliers on both sides of every block edge included."""
    import tq_cli.quant.grouped as grouped
    from tq_kernels.reference import dequantize_codes

    w = torch.randn(61, 200, generator=torch.Generator().manual_seed(0))
    q = grouped.quantize_rotated(w, QuantSpec(bits=3, group_size=64, outliers=0.02),
                                 grouped.Rotation("none", 200, 64, 0))
    whole = dequantize_codes(q.codes, q.scales, q.codebook, bits=3, group_size=64,
                             in_features=200)
    whole.view(-1).index_add_(0, q.outlier_idx.long(), q.outlier_val.float())
    monkeypatch.setattr(grouped, "CHUNK_ELEMENTS", 7 * 200)
    assert len(grouped.row_blocks(q)) == 9
    assert torch.equal(grouped.dequantize_rotated(q), whole)
    rows = torch.cat([grouped.dequantize_rows(q, r0, r1) for r0, r1 in grouped.row_blocks(q)])
    assert torch.equal(rows, whole)

"""tq's native KV-cache attention kernel (tq_kernels.kv), every variant this CPU runs,
against the torch reference (tq_kernels.kv_reference).

score_codes and accumulate_codes read packed codes and fp16 scales straight from the
cache, which hands them views along T of a larger buffer: the cases below slice such a
buffer (any batch / head strides, scales with a stride over T too), use negative scales
(their sign bit is a flag, only |s| counts), head dims with a partial last chunk (40, 24)
and caches long enough for several work items. Each SIMD variant is forced with `isa=`;
one above this CPU's is skipped. The kernel sums in another order than the reference, so
results agree to float32 rounding, relative to the magnitude of the sums.
"""

from __future__ import annotations

import pytest
import torch

from tq_kernels import cpu_build, kv, kv_reference
from tq_kernels.packing import pack_codes, packed_row_bytes

if cpu_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine (install g++ or set CXX): coded KV "
                "attention runs the torch reference on CPU", allow_module_level=True)

ISAS = ("scalar", "avx2", "avx512")
H = 2
RTOL = 1e-5


def _runs(isa: str) -> None:
    if not kv.available():
        pytest.fail("the native KV kernel did not build (see the warning)")
    if isa not in kv.isas():
        pytest.skip(f"this CPU has no {isa} (best: {kv.cpu_isa()})")


class Case:
    """Operands of one call: codes and scales as views of a larger cache buffer."""

    def __init__(self, bits: int, d: int, g: int, b: int, t: int, *, seed: int = 0,
                 head_major: bool = False, scale_stride: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed * 7919 + bits * 1000 + d * 10 + g + b + t)
        nbytes = packed_row_bytes(d, bits)
        cap, start = t + 9, 5
        raw = torch.randint(0, 2 ** bits, (b * H * cap, d), generator=gen)
        packed = pack_codes(raw, bits)
        if head_major:  # a [H, B, cap, bytes] buffer seen as [B, H, ...]: odd B/H strides
            buf = packed.reshape(H, b, cap, nbytes).transpose(0, 1)
        else:
            buf = packed.reshape(b, H, cap, nbytes)
        self.codes = buf[:, :, start:start + t]
        s = torch.randn(b, H, cap * scale_stride, generator=gen).half()
        self.scale = s[:, :, start * scale_stride:(start + t) * scale_stride:scale_stride]
        self.levels = torch.randn(2 ** bits, generator=gen)
        self.q = torch.randn(b, H, g, d, generator=gen)
        self.p = torch.softmax(torch.randn(b, H, g, t, generator=gen), dim=-1)
        self.bits, self.d = bits, d
        assert t == 0 or not self.codes.is_contiguous()

    def score(self, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (kv.score_codes(self.q, self.codes, self.scale, self.levels, self.bits,
                               isa=isa),
                kv_reference.score_codes(self.q, self.codes, self.scale, self.levels,
                                         self.bits))

    def accumulate(self, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (kv.accumulate_codes(self.p, self.codes, self.scale, self.levels, self.bits,
                                    self.d, isa=isa),
                kv_reference.accumulate_codes(self.p, self.codes, self.scale, self.levels,
                                              self.bits, self.d))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    assert torch.isfinite(got).all(), what
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= RTOL * max(scale, 1e-30), f"{what}: max error {err:.3g} of {scale:.3g}"


# (G, B, T) per case: every G, B and T of the brief, without their full product.
SHAPES = [(1, 1, 1), (2, 3, 7), (8, 1, 300), (2, 3, 300), (1, 1, 7)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [64, 128, 256, 40, 24])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_every_variant_is_the_reference(isa: str, bits: int, d: int) -> None:
    _runs(isa)
    for i, (g, b, t) in enumerate(SHAPES):
        case = Case(bits, d, g, b, t, head_major=i % 2 == 1)
        _close(*case.score(isa), f"score bits={bits} d={d} G={g} B={b} T={t}")
        _close(*case.accumulate(isa), f"accumulate bits={bits} d={d} G={g} B={b} T={t}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [8, 16, 136, 240])
def test_odd_widths_and_strided_scales(isa: str, d: int) -> None:
    """The hi/lo channel split's widths (any multiple of 8) and scales that are every
    other element of their buffer."""
    _runs(isa)
    for bits in (3, 4, 5):
        case = Case(bits, d, 3, 2, 37, scale_stride=2)
        _close(*case.score(isa), f"score bits={bits} d={d}")
        _close(*case.accumulate(isa), f"accumulate bits={bits} d={d}")


@pytest.mark.parametrize("isa", ISAS)
def test_long_cache_spans_several_work_items(isa: str) -> None:
    _runs(isa)
    case = Case(4, 64, 3, 1, 2500, seed=1)
    _close(*case.score(isa), "score")
    _close(*case.accumulate(isa), "accumulate")


def test_accumulate_does_not_depend_on_the_thread_count() -> None:
    _runs("scalar")
    case = Case(3, 64, 3, 1, 4100, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.accumulate(None)[0]
        torch.set_num_threads(2)
        two = case.accumulate(None)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", ISAS)
def test_empty_cache(isa: str) -> None:
    _runs(isa)
    case = Case(4, 64, 2, 3, 0)
    score = kv.score_codes(case.q, case.codes, case.scale, case.levels, 4, isa=isa)
    assert score.shape == (3, H, 2, 0) and score.dtype == torch.float32
    out = kv.accumulate_codes(case.p, case.codes, case.scale, case.levels, 4, 64, isa=isa)
    assert out.shape == (3, H, 2, 64) and not out.any()


def test_negative_scales_count_by_magnitude() -> None:
    _runs("scalar")
    case = Case(4, 64, 2, 1, 20)
    flipped = (-case.scale.abs()).contiguous()
    plain = case.scale.abs().contiguous()
    for isa in kv.isas():
        a = kv.score_codes(case.q, case.codes, flipped, case.levels, 4, isa=isa)
        b = kv.score_codes(case.q, case.codes, plain, case.levels, 4, isa=isa)
        assert torch.equal(a, b)
        a = kv.accumulate_codes(case.p, case.codes, flipped, case.levels, 4, 64, isa=isa)
        b = kv.accumulate_codes(case.p, case.codes, plain, case.levels, 4, 64, isa=isa)
        assert torch.equal(a, b)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("scalar")
    assert kv.backend_for("cpu") == f"cpu-{kv.active_isa()}"
    case = Case(5, 40, 2, 1, 9)
    _close(*case.score(None), "score")
    _close(*case.accumulate(None), "accumulate")
    # 6-bit codes have no native variant: the reference runs.
    six = Case(6, 24, 2, 1, 5)
    _close(*six.score(None), "6-bit score")
    _close(*six.accumulate(None), "6-bit accumulate")
    # Inputs that need gradients take the differentiable reference.
    q = case.q.clone().requires_grad_(True)
    kv.score_codes(q, case.codes, case.scale, case.levels, 5).sum().backward()
    assert q.grad is not None
    monkeypatch.setenv("TQ_FORCE_REFERENCE", "1")
    assert kv.backend_for("cpu") == "torch"
    _close(*case.score(None), "forced reference")


def test_bad_shapes_are_value_errors() -> None:
    _runs("scalar")
    case = Case(4, 64, 2, 1, 9)
    with pytest.raises(ValueError):
        kv.score_codes(case.q[..., :56], case.codes, case.scale, case.levels, 4, isa="scalar")
    with pytest.raises(ValueError):
        kv.accumulate_codes(case.p[..., :5], case.codes, case.scale, case.levels, 4, 64,
                            isa="scalar")

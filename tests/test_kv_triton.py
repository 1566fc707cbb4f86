"""The Triton KV-code attention kernels under TRITON_INTERPRET=1 on CPU against their
torch reference (tq_kernels.kv_reference)."""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tq_kernels import kv_reference as ref
from tq_kernels.packing import pack_codes

kt = pytest.importorskip("tq_kernels.kv_triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed: int, bits: int, d: int, b: int, h: int, g: int, t: int,
            lead: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:
    """q [b, h, g, d], p [b, h, g, t], and codes / scale as views of T tokens starting at
    `lead` in a bigger buffer along dim 2 (non-contiguous), with signed scales."""
    gen = torch.Generator().manual_seed(seed)
    tbuf = t + lead + 5
    raw = torch.randint(0, 2 ** bits, (b * h * tbuf, d), generator=gen)
    packed = pack_codes(raw, bits).reshape(b, h, tbuf, -1)
    scale = torch.randn(b, h, tbuf, generator=gen).to(torch.float16)
    levels = torch.sort(torch.randn(2 ** bits, generator=gen)).values
    q = torch.randn(b, h, g, d, generator=gen)
    p = torch.softmax(torch.randn(b, h, g, t, generator=gen), dim=-1)
    codes = packed.to(DEVICE)[:, :, lead:lead + t, :]
    sc = scale.to(DEVICE)[:, :, lead:lead + t]
    return q.to(DEVICE), p.to(DEVICE), codes, sc, levels.to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    tol = 2e-6 * float(want.abs().max()) + 1e-6
    assert float((got.cpu() - want.cpu()).abs().max()) <= tol


CASES = [(bits, d, g, t) for bits in range(1, 6) for d in (64, 40) for g in (1, 4)
         for t in (1, 33)]


@pytest.mark.parametrize(("bits", "d", "g", "t"), CASES)
def test_score_matches_reference(bits: int, d: int, g: int, t: int) -> None:
    b = 1 + (bits + t) % 2
    q, _, codes, scale, levels = _inputs(bits * 1000 + d * 10 + g + t, bits, d, b, 2, g, t)
    assert not codes.is_contiguous() and not scale.is_contiguous()
    assert bool((scale < 0).any()) or t == 1
    got = kt.score_codes(q, codes, scale, levels, bits)
    want = ref.score_codes(q.cpu(), codes.cpu(), scale.cpu(), levels.cpu(), bits)
    _close(got, want)


@pytest.mark.parametrize(("bits", "d", "g", "t"), CASES)
def test_accumulate_matches_reference(bits: int, d: int, g: int, t: int) -> None:
    b = 1 + (bits + t + 1) % 2
    _, p, codes, scale, levels = _inputs(bits * 977 + d * 10 + g + t, bits, d, b, 2, g, t)
    got = kt.accumulate_codes(p, codes, scale, levels, bits, d)
    want = ref.accumulate_codes(p.cpu(), codes.cpu(), scale.cpu(), levels.cpu(), bits, d)
    _close(got, want)


@pytest.mark.parametrize("split_tokens", [16, 20])
def test_accumulate_split_tokens(split_tokens: int) -> None:
    """Several token splits and the fixed-order second pass give the same sums."""
    _, p, codes, scale, levels = _inputs(7, 3, 40, 2, 2, 3, 33)
    got = kt.accumulate_codes(p, codes, scale, levels, 3, 40, split_tokens=split_tokens)
    want = ref.accumulate_codes(p.cpu(), codes.cpu(), scale.cpu(), levels.cpu(), 3, 40)
    _close(got, want)
    again = kt.accumulate_codes(p, codes, scale, levels, 3, 40, split_tokens=split_tokens)
    assert torch.equal(got, again)


@pytest.mark.parametrize(("bits", "d"), [(7, 24), (8, 128), (6, 200)])
def test_more_bits_and_widths(bits: int, d: int) -> None:
    """Three-plane and byte-wide codes; a d-block loop (d > 64) with a ragged last block."""
    q, p, codes, scale, levels = _inputs(bits + d, bits, d, 1, 1, 2, 17)
    _close(kt.score_codes(q, codes, scale, levels, bits),
           ref.score_codes(q.cpu(), codes.cpu(), scale.cpu(), levels.cpu(), bits))
    _close(kt.accumulate_codes(p, codes, scale, levels, bits, d),
           ref.accumulate_codes(p.cpu(), codes.cpu(), scale.cpu(), levels.cpu(), bits, d))


def test_no_tokens() -> None:
    q, p, codes, scale, levels = _inputs(1, 2, 64, 1, 2, 2, 0)
    assert kt.score_codes(q, codes, scale, levels, 2).shape == (1, 2, 2, 0)
    out = kt.accumulate_codes(p, codes, scale, levels, 2, 64)
    assert out.shape == (1, 2, 2, 64) and not bool(out.any())


def test_bad_input() -> None:
    q, p, codes, scale, levels = _inputs(2, 4, 64, 1, 1, 1, 4)
    with pytest.raises(ValueError, match="bytes per token"):
        kt.score_codes(q, codes, scale, levels, 3)
    with pytest.raises(ValueError, match="tokens"):
        kt.accumulate_codes(p[..., :3], codes, scale, levels, 4, 64)
    with pytest.raises(NotImplementedError):
        kt.score_codes(q, codes, scale, levels, 9)

import pytest
import torch

from tq_kernels.packing import pack_codes, packed_row_bytes, unpack_codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 200, 576])
def test_pack_unpack_round_trip(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (5, n), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, packed_row_bytes(n, bits))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_packed_size_is_exact_bits() -> None:
    # 3 bits: a 2-bit plane and a 1-bit plane; 576 codes -> 576 * 3 / 8 bytes.
    assert packed_row_bytes(576, 3) == 216
    assert packed_row_bytes(200, 4) == 100
    assert packed_row_bytes(13, 2) == 4  # padded to 16 codes


def test_layout_is_little_endian_planes() -> None:
    codes = torch.tensor([[1, 2, 3, 0, 5, 6, 7, 4]], dtype=torch.uint8)
    packed = pack_codes(codes, 3)
    # low plane (2 bits): 1,2,3,0 | 1,2,3,0 -> byte = 1 | 2<<2 | 3<<4 | 0<<6 = 57
    assert packed[0, :2].tolist() == [57, 57]
    # high plane (1 bit): 0,0,0,0,1,1,1,1 -> 0b11110000
    assert packed[0, 2].item() == 0b11110000


def test_unpack_rejects_wrong_row_length() -> None:
    with pytest.raises(ValueError, match="4 bytes, expected 3 for 8 codes of 3 bits"):
        unpack_codes(torch.zeros(1, 4, dtype=torch.uint8), 3, 8)


def test_packing_by_row_blocks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_kernels import packing

    codes = torch.randint(0, 16, (37, 300), dtype=torch.uint8)
    whole = packing.pack_codes(codes, 4)
    monkeypatch.setattr(packing, "PACK_CHUNK_ELEMENTS", 5 * 320)
    assert torch.equal(packing.pack_codes(codes, 4), whole)
    assert torch.equal(packing.unpack_codes(whole, 4, 300), codes)

"""The packed code layout of tq's checkpoint format (unchanged since version 1), defined
once for the writer and the kernels.

A row of `n` codes of `bits` bits is split into bit planes of widths 4, 2 or 1 (lowest
bits first): 2 -> (2,), 3 -> (2, 1), 4 -> (4,), 8 -> (8,). Each plane stores the row,
padded with zero codes to a multiple of 8, little-endian within a byte: code j of a plane
of width w lives in byte j*w // 8 at bit (j*w) % 8. A packed row is plane 0's bytes, then
plane 1's. Planes keep every code inside one byte, so a kernel unpacks with a shift and a
mask, and a 3-bit row costs exactly 3/8 byte per code.
"""

from __future__ import annotations

import torch

PLANES: dict[int, tuple[int, ...]] = {
    1: (1,),
    2: (2,),
    3: (2, 1),
    4: (4,),
    5: (4, 1),
    6: (4, 2),
    7: (4, 2, 1),
    8: (8,),
}


def padded_length(n: int) -> int:
    """Codes per plane row: n rounded up to a multiple of 8."""
    return -(-n // 8) * 8


def packed_row_bytes(n: int, bits: int) -> int:
    """Bytes of one packed row of n codes."""
    return padded_length(n) * bits // 8


def _planes(bits: int) -> tuple[int, ...]:
    if bits not in PLANES:
        raise ValueError(f"bits must be one of {sorted(PLANES)}, got {bits}")
    return PLANES[bits]


PACK_CHUNK_ELEMENTS = 1 << 22


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [rows, n] (each < 2**bits) into uint8 [rows, packed_row_bytes]."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
    rows, n = codes.shape
    npad = padded_length(n)
    block = max(1, PACK_CHUNK_ELEMENTS // max(1, npad))
    if rows > block:  # a block of rows at a time: the int32 and int64 temporaries of a
        # whole 4096 x 14336 tensor are about 1 GB
        return torch.cat([pack_codes(codes[r:r + block], bits)
                          for r in range(0, rows, block)])
    c = torch.zeros(rows, npad, dtype=torch.int32, device=codes.device)
    c[:, :n] = codes.to(torch.int32)
    out = []
    shift = 0
    for w in _planes(bits):
        plane = (c >> shift) & ((1 << w) - 1)
        per = 8 // w
        plane = plane.view(rows, npad // per, per)
        weights = torch.tensor([1 << (t * w) for t in range(per)], dtype=torch.int32,
                               device=codes.device)
        out.append((plane * weights).sum(dim=-1).to(torch.uint8))
        shift += w
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [rows, packed_row_bytes] -> uint8 codes [rows, n]."""
    rows = packed.shape[0]
    npad = padded_length(n)
    if packed.shape[1] != npad * bits // 8:
        raise ValueError(
            f"packed rows have {packed.shape[1]} bytes, expected {npad * bits // 8} "
            f"for {n} codes of {bits} bits"
        )
    p = packed.to(torch.int32)
    codes = torch.zeros(rows, npad, dtype=torch.int32, device=packed.device)
    start = 0
    shift = 0
    for w in _planes(bits):
        per = 8 // w
        nbytes = npad // per
        plane = p[:, start:start + nbytes]
        shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * w
        vals = (plane.unsqueeze(-1) >> shifts) & ((1 << w) - 1)
        codes |= vals.reshape(rows, npad) << shift
        start += nbytes
        shift += w
    return codes[:, :n].to(torch.uint8)

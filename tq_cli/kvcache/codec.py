"""TurboQuant quantizers for key and value vectors of head_dim d (pure torch).

Zandieh et al. 2025, "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate" (arXiv:2504.19874):

- `MSECodec` is TurboQuant_mse (Section 3.1, Algorithm 1): the norm is stored in fp16, the
  unit vector is rotated by a seeded random rotation R, and every rotated coordinate is
  quantized with the Lloyd-Max codebook of its exact law (`kvcache.codebook`);
  x_hat = |x| * R^T c[codes].
- `QJLSketch` is the second stage of TurboQuant_prod (Section 3.2, Algorithm 2): the
  residual r = x - x_hat_mse is stored as sign(S r) (1 bit per coordinate, S Gaussian)
  plus |r| in fp16, and decoded as |r| sqrt(pi/2) / d * S^T sign(S r), an unbiased
  estimate of r for inner products.
- `StreamCodec` is one stream (keys or values) at possibly fractional bits: integer bits
  use one `MSECodec`; b = n + f bits split the channels into a fixed high set at n + 1
  bits and the rest at n bits, two independent instances (the paper's outlier channels,
  Section 4.3). The channel sets are chosen per layer and head by the cache, once.

Rotations are shared by every layer and head of a stream (one d x d matrix, 16 KB at
d = 64): any fixed random rotation gives each vector the same distortion guarantee, and
a float32 matrix per layer and head would hold 2.9 MB on SmolLM2 (30 layers, 3 KV heads,
keys and values), the cache of ~450 tokens at 3.5 bits. The randomized Hadamard
rotation is tq's seeded one (`tq_cli.quant.rotation`), applied as that dense matrix: one
matmul per batch of vectors is faster than the butterfly in torch.
Tensors are [..., d] in and out; encodings are dicts of tensors with the same leading
shape, so the cache can append and slice them along the token axis.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F

from tq_cli.kvcache.codebook import sphere_codebook
from tq_cli.kvcache.spec import KVRotation, Rescale, split_channels
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import RotationSpec
from tq_kernels.packing import PLANES, pack_codes, packed_row_bytes, padded_length, unpack_codes

Encoded = dict[str, torch.Tensor]
FP16_MAX = 65504.0


def derive_seed(seed: int, *parts: object) -> int:
    """A 32-bit seed for one named piece of rotation material (stable across runs)."""
    return zlib.crc32(repr((seed, *parts)).encode())


def rotation_matrix(kind: KVRotation, d: int, seed: int) -> torch.Tensor:
    """Dense float32 [d, d] R with x @ R the rotation; built from tq's seeded material."""
    block = 1 << (d.bit_length() - 1) if kind == "hadamard" else d
    rot = make_rotation(RotationSpec(kind=kind, block=block, seed=seed), d, block)
    return rot.rotate(torch.eye(d, dtype=torch.float32)).contiguous()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    lead = codes.shape[:-1]
    return pack_codes(codes.reshape(-1, codes.shape[-1]), bits).reshape(*lead, -1)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    lead = packed.shape[:-1]
    return unpack_codes(packed.reshape(-1, packed.shape[-1]), bits, n).reshape(*lead, n)


def _low_high_table(levels: torch.Tensor, width: int) -> torch.Tensor:
    """For a layout of a `width`-bit plane and a 1-bit plane (3 bits: 2+1, 5 bits: 4+1):
    [256 * 2^c, c] levels of the c = 8 // width codes whose low bits are one byte b of
    the wide plane and whose high bits are the c bits h from the 1-bit plane, at row
    b + 256 h."""
    c = 8 // width
    row = torch.arange(256 << c, device=levels.device)[:, None]
    t = torch.arange(c, device=levels.device)[None, :]
    low = (row % 256 >> (width * t)) & ((1 << width) - 1)
    codes = low | (((row // 256 >> t) & 1) << width)
    return levels[codes]


def _byte_tables(bits: int, levels: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Per bit plane of the packed layout: (width, table [256, 8 // width]) giving, for a
    byte, its codes' contribution (shifted into place) or, for a one-plane layout, their
    codebook values directly."""
    planes = PLANES[bits]
    out, shift = [], 0
    byte = torch.arange(256, device=levels.device)[:, None]
    for width in planes:
        pos = torch.arange(8 // width, device=levels.device)[None, :] * width
        part = ((byte >> pos) & ((1 << width) - 1)) << shift
        out.append((width, levels[part] if len(planes) == 1 else part.float()))
        shift += width
    return out


class MSECodec:
    """TurboQuant_mse for vectors of dimension d at an integer number of bits.

    `rescale` sets what the stored fp16 scale is: "none" the vector's norm (the paper:
    x_hat = |x| R^T c, which shrinks x_hat by 1 - D on average, D the distortion);
    "norm" the norm divided by |c|, so |x_hat| = |x| exactly; "unbiased" the norm
    divided by 1 - D, so E[<q, x_hat>] = <q, x> over the rotation (Section 3.2's
    observation that the MSE quantizer is biased, fixed by a constant). All three store
    the same bytes.
    """

    def __init__(self, d: int, bits: int, kind: KVRotation, seed: int,
                 rescale: Rescale = "none") -> None:
        self.d, self.bits, self.rescale = d, bits, rescale
        levels, mse = sphere_codebook(d, bits)
        self.shrink = 1 - d * mse
        self.levels = torch.tensor(levels, dtype=torch.float32)
        self.mids = (self.levels[1:] + self.levels[:-1]) / 2
        self.rot = rotation_matrix(kind, d, seed)
        self._tables: list[tuple[int, torch.Tensor]] | None = None
        self._table_lh: torch.Tensor | None = None

    @property
    def code_bytes(self) -> int:
        return packed_row_bytes(self.d, self.bits)

    def to(self, device: torch.device) -> MSECodec:
        self.levels, self.mids, self.rot = (t.to(device) for t in (self.levels, self.mids,
                                                                     self.rot))
        self._tables = self._table_lh = None
        return self

    def material_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.levels, self.rot))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed codes, fp16 scale, float32 reconstruction) of vectors [..., d]."""
        norm = x.norm(dim=-1)
        y = (x / norm.clamp_min(torch.finfo(torch.float32).tiny)[..., None]) @ self.rot
        codes = torch.bucketize(y, self.mids)
        c = self.levels[codes]
        if self.rescale == "norm":
            norm = norm / c.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        elif self.rescale == "unbiased":
            norm = norm / self.shrink
        scale = norm.clamp(max=FP16_MAX).to(torch.float16)
        return (_pack(codes.to(torch.uint8), self.bits), scale,
                (c @ self.rot.T) * scale.float()[..., None])

    def decode(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (self._levels_of(packed) @ self.rot.T) * scale.float()[..., None]

    def _levels_low_high(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        """3 and 5 bits (a `width`-bit plane, then a 1-bit plane): each byte of the wide
        plane and the matching c = 8 // width bits of the 1-bit plane index one table row
        of c levels, one gather for every code."""
        if self._table_lh is None:
            self._table_lh = _low_high_table(self.levels, width)
        c = 8 // width
        n = padded_length(self.d)
        low = packed[..., :n * width // 8].int()
        high = packed[..., n * width // 8:].int()
        bits = torch.stack([(high >> (c * t)) & ((1 << c) - 1) for t in range(8 // c)],
                           dim=-1).flatten(-2)
        out = F.embedding(low + 256 * bits, self._table_lh).flatten(-2)
        return out[..., :self.d] if n != self.d else out

    def _levels_of(self, packed: torch.Tensor) -> torch.Tensor:
        """Codebook values of packed codes through byte lookup tables: one gather per bit
        plane of the format (tq_kernels.packing), none of the shifts and masks of a
        general unpack. This runs for every cached token at every decode step."""
        if self.bits in (3, 5):
            return self._levels_low_high(packed, PLANES[self.bits][0])
        lead = packed.shape[:-1]
        if self._tables is None:
            self._tables = _byte_tables(self.bits, self.levels)
        parts, start = [], 0
        for width, table in self._tables:
            nbytes = padded_length(self.d) * width // 8
            parts.append(F.embedding(packed[..., start:start + nbytes].int(), table)
                         .reshape(*lead, -1))
            start += nbytes
        if len(parts) == 1:  # one plane: the table holds codebook values already
            return parts[0][..., :self.d]
        codes = torch.stack(parts).sum(0)[..., :self.d]
        return self.levels[codes.long()]


class QJLSketch:
    """1-bit Quantized Johnson-Lindenstrauss sketch of a residual (Section 3.2)."""

    def __init__(self, d: int, seed: int) -> None:
        self.d = d
        gen = torch.Generator().manual_seed(seed)
        self.s = torch.randn(d, d, generator=gen, dtype=torch.float32)

    def to(self, device: torch.device) -> QJLSketch:
        self.s = self.s.to(device)
        return self

    def material_bytes(self) -> int:
        return self.s.numel() * self.s.element_size()

    def encode(self, r: torch.Tensor) -> Encoded:
        norm = r.norm(dim=-1).clamp(max=FP16_MAX).to(torch.float16)
        signs = (r @ self.s.T >= 0).to(torch.uint8)
        return {"qjl": _pack(signs, 1), "qjl_norm": norm}

    def decode(self, enc: Encoded) -> torch.Tensor:
        z = _unpack(enc["qjl"], 1, self.d).float() * 2 - 1
        scale = math.sqrt(math.pi / 2) / self.d
        return (z @ self.s) * (enc["qjl_norm"].float() * scale)[..., None]


class StreamCodec:
    """One stream (keys or values) of head_dim d at `bits` (fractional: channel split).

    With `qjl`, the codes get one bit less and the residual a QJL sketch, so the stored
    bits per coordinate stay `bits` (plus one more fp16 norm per vector).
    """

    def __init__(self, d: int, bits: float, kind: KVRotation, seed: int, stream: str,
                 qjl: bool = False, rescale: Rescale = "none") -> None:
        self.d, self.bits, self.qjl = d, bits, qjl
        base, high = split_channels(bits - 1 if qjl else bits, d)
        if high and (high < 3 or d - high < 3):
            raise ValueError(f"{bits} bits over head_dim {d} puts {high} channels at "
                             f"{base + 1} bits; use a fraction that gives 3 to {d - 3}")
        self.base, self.high = base, high
        if high:
            self.hi: MSECodec | None = MSECodec(
                high, base + 1, kind, derive_seed(seed, stream, "hi", high), rescale)
            self.lo = MSECodec(d - high, base, kind, derive_seed(seed, stream, "lo", d - high),
                               rescale)
        else:
            self.hi = None
            self.lo = MSECodec(d, base, kind, derive_seed(seed, stream, d), rescale)
        self.sketch = QJLSketch(d, derive_seed(seed, stream, "qjl", d)) if qjl else None

    @property
    def code_bits(self) -> float:
        """Bits per coordinate in codes and sketch, without norms."""
        return self.base + self.high / self.d + (1 if self.qjl else 0)

    def to(self, device: torch.device) -> StreamCodec:
        for part in (self.hi, self.lo, self.sketch):
            if part is not None:
                part.to(device)
        return self

    def material_bytes(self) -> int:
        return sum(p.material_bytes() for p in (self.hi, self.lo, self.sketch) if p is not None)

    def choose_channels(self, x: torch.Tensor) -> torch.Tensor | None:
        """A channel order per head from sample vectors [B, H, T, d]: the `high` channels
        with the largest mean square (the outlier channels) first, then the rest, each
        part sorted. int16 [H, d]; None without a split."""
        if not self.high:
            return None
        energy = x.float().pow(2).mean(dim=(0, 2))
        top = torch.zeros_like(energy, dtype=torch.bool)
        top.scatter_(1, energy.topk(self.high, dim=-1).indices, True)
        # Stable sort on "not outlier" keeps each part in channel order.
        return (~top).to(torch.uint8).sort(dim=-1, stable=True).indices.to(torch.int16)

    def encode(self, x: torch.Tensor, order: torch.Tensor | None) -> Encoded:
        """Encode vectors [B, H, T, d] (any float dtype); `order` from choose_channels."""
        x = x.float()
        if self.hi is None:
            codes, scale, x_hat = self.lo.encode(x)
            enc = {"codes": codes, "norm": scale}
        else:
            assert order is not None
            idx = order.long()[None, :, None, :].expand_as(x)
            xs = x.gather(-1, idx)
            ch, nh, rh = self.hi.encode(xs[..., :self.high])
            cl, nl, rl = self.lo.encode(xs[..., self.high:])
            enc = {"codes_hi": ch, "norm_hi": nh, "codes_lo": cl, "norm_lo": nl}
            x_hat = torch.empty_like(x).scatter_(-1, idx, torch.cat((rh, rl), dim=-1))
        if self.sketch is not None:
            enc.update(self.sketch.encode(x - x_hat))
        return enc

    def decode(self, enc: Encoded, order: torch.Tensor | None) -> torch.Tensor:
        """Float32 vectors [B, H, T, d] from an encoding."""
        if self.hi is None:
            out = self.lo.decode(enc["codes"], enc["norm"])
        else:
            assert order is not None
            parts = torch.cat((self.hi.decode(enc["codes_hi"], enc["norm_hi"]),
                               self.lo.decode(enc["codes_lo"], enc["norm_lo"])), dim=-1)
            idx = order.long()[None, :, None, :].expand_as(parts)
            out = torch.empty_like(parts).scatter_(-1, idx, parts)
        if self.sketch is not None:
            out = out + self.sketch.decode(enc)
        return out

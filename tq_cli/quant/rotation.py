"""Rotation material drawn from a seed, and its application to weights (docs/design.md, math 1).

The material (a sign vector, or orthogonal matrices) is what a checkpoint stores, so a
model never depends on an RNG reproducing the same numbers elsewhere; `verify` compares
stored material with a fresh draw and says when they differ. The arithmetic itself lives
in `tq_kernels.rotation`, shared with the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tq_cli.errors import UnsupportedError
from tq_cli.quant.spec import RotationKind, RotationSpec
from tq_kernels import rotation as rk

ROTATION_PREFIX = "tq.rotation."


@dataclass(frozen=True)
class Rotation:
    """A block-diagonal rotation of n input columns."""

    kind: RotationKind
    n: int
    block: int
    seed: int
    signs: torch.Tensor | None = None  # int8 ±1 [n] (hadamard)
    matrix: torch.Tensor | None = None  # float32 [block, block] (orthogonal, if n >= block)
    tail: torch.Tensor | None = None  # float32 [n % block, n % block] (orthogonal)

    @property
    def rotation_id(self) -> str:
        return rotation_id(self.kind, self.n, self.block, self.seed)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x @ R over the last dimension."""
        if self.kind == "hadamard":
            assert self.signs is not None
            return rk.hadamard_rotate(x, self.signs, self.block)
        if self.kind == "orthogonal":
            return rk.orthogonal_rotate(x, self.matrix, self.tail, self.block)
        return x

    def rotate_rows(self, w: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
        """w @ R for a large 2-D weight, a block of rows at a time, so the transform's
        temporaries stay a few MB instead of several copies of the whole weight."""
        if self.kind == "none":
            return w
        out = torch.empty_like(w)
        rows = max(1, chunk_elements // max(1, w.shape[1]))
        for r in range(0, w.shape[0], rows):
            out[r:r + rows] = self.rotate(w[r:r + rows])
        return out

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """x @ R.T over the last dimension."""
        if self.kind == "hadamard":
            assert self.signs is not None
            return rk.hadamard_unrotate(x, self.signs, self.block)
        if self.kind == "orthogonal":
            return rk.orthogonal_unrotate(x, self.matrix, self.tail, self.block)
        return x

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored material, by storage key."""
        out = {}
        for suffix, t in (("signs", self.signs), ("matrix", self.matrix), ("tail", self.tail)):
            if t is not None:
                out[f"{ROTATION_PREFIX}{self.rotation_id}.{suffix}"] = t
        return out


def rotation_id(kind: str, n: int, block: int, seed: int) -> str:
    return f"{kind}-n{n}-b{block}-s{seed}"


def material_layout(kind: RotationKind, n: int, block: int) -> dict[str, tuple[str, list[int]]]:
    """suffix -> (safetensors dtype, shape) of the material, known before any compute."""
    if kind == "hadamard":
        return {"signs": ("I8", [n])}
    if kind == "orthogonal":
        out = {"matrix": ("F32", [block, block])} if n >= block else {}
        if n % block:
            out["tail"] = ("F32", [n % block, n % block])
        return out
    return {}


def _haar(size: int, gen: torch.Generator) -> torch.Tensor:
    # QR of a Gaussian with the signs of R's diagonal folded in is Haar-distributed
    # (Mezzadri 2007, "How to generate random matrices from the classical compact groups").
    a = torch.randn(size, size, dtype=torch.float64, generator=gen)
    q, r = torch.linalg.qr(a)
    d = torch.sign(torch.diagonal(r))
    d[d == 0] = 1
    return (q * d).to(torch.float32)


def resolve_block(spec: RotationSpec, group_size: int) -> int:
    block = spec.resolved_block(group_size)
    if spec.kind == "hadamard" and block & (block - 1):
        raise UnsupportedError(
            f"the Hadamard rotation block {block} (the group size) is not a power of two; "
            "pass --rotation-block 64 or 128, or --rotation orthogonal"
        )
    return block


def make_rotation(spec: RotationSpec, n: int, group_size: int) -> Rotation:
    """Draw the material for n input columns from spec.seed (CPU generator, deterministic)."""
    block = resolve_block(spec, group_size)
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.kind == "hadamard":
        signs = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(torch.int8)
        return Rotation("hadamard", n, block, spec.seed, signs=signs)
    if spec.kind == "orthogonal":
        matrix = _haar(block, gen) if n >= block else None
        tail = _haar(n % block, gen) if n % block else None
        return Rotation("orthogonal", n, block, spec.seed, matrix=matrix, tail=tail)
    return Rotation("none", n, block, spec.seed)


def rotation_from_tensors(kind: RotationKind, n: int, block: int, seed: int,
                          tensors: dict[str, torch.Tensor]) -> Rotation:
    """Rebuild a Rotation from stored material keyed by suffix (signs, matrix, tail)."""
    return Rotation(kind, n, block, seed, signs=tensors.get("signs"),
                    matrix=tensors.get("matrix"), tail=tensors.get("tail"))


def verify(stored: Rotation) -> bool:
    """True when the stored material equals a fresh draw from its seed."""
    fresh = make_rotation(RotationSpec(kind=stored.kind, block=stored.block, seed=stored.seed),
                          stored.n, stored.block)
    for a, b in ((stored.signs, fresh.signs), (stored.matrix, fresh.matrix),
                 (stored.tail, fresh.tail)):
        if (a is None) != (b is None):
            return False
        if a is None or b is None:
            continue
        a = a.cpu()
        if a.shape != b.shape:
            return False
        # Signs must match exactly; matrices come from a float64 QR whose last bit may
        # differ between LAPACK builds, so they match to a tolerance far below any seed
        # difference (two seeds differ by O(1) entries).
        if a.dtype == torch.int8 and not torch.equal(a, b):
            return False
        if a.dtype != torch.int8 and not torch.allclose(a, b, atol=1e-5, rtol=0):
            return False
    return True

"""Tensor-parallel slicing of tq's stored tensors, in plain torch (no vLLM import).

vLLM splits a column-parallel layer (q/k/v, gate/up) by output rows and a row-parallel
layer (o_proj, down_proj) by input columns, evenly over the ranks
(vllm/model_executor/layers/linear.py: `ColumnParallelLinear`, `RowParallelLinear`).
For a tq weight (docs/format.md) that means:

- rows: codes and scales are per row, so any row range works; outliers are flat indices
  into [out, in], kept when their row falls in the range and re-indexed;
- columns: each rank computes `(x_r R_r) W_r^T` on its own columns, so every rank must
  hold whole scale groups and whole rotation blocks (R is block diagonal, design.md
  math 1); codes are unpacked, cut and packed again, scales cut by group, outliers
  kept when their column falls in the range and re-indexed.
"""

from __future__ import annotations

import math

import torch

from tq_kernels.packing import pack_codes, unpack_codes

MAX_TP = 16  # the tensor-parallel sizes a refusal lists are looked for up to this


def column_unit(group_size: int, block: int | None) -> int:
    """Columns a rank's share must be a multiple of: whole groups and whole blocks."""
    return math.lcm(group_size, block) if block else group_size


def row_split_ok(in_features: int, tp: int, group_size: int, block: int | None) -> bool:
    """Can `in_features` input columns be split evenly over `tp` ranks for tq?"""
    if in_features % tp:
        return False
    return tp == 1 or (in_features // tp) % column_unit(group_size, block) == 0


def working_tp_sizes(in_features: int, group_size: int, block: int | None) -> list[int]:
    return [t for t in range(1, MAX_TP + 1) if row_split_ok(in_features, t, group_size, block)]


def split_refusal(layer: str, in_features: int, tp: int, group_size: int,
                  block: int | None) -> str:
    """The one line vLLM stops with when a row-parallel layer cannot be split."""
    share = (f"{in_features / tp:g} columns per rank" if in_features % tp == 0
             else f"{in_features} columns do not divide by {tp}")
    rot = f"rotation block {block}" if block else "no rotation"
    sizes = ", ".join(map(str, working_tp_sizes(in_features, group_size, block)))
    return (f"tq: cannot split {layer} for tensor_parallel_size={tp}: its input width "
            f"{in_features} ({share}) must give every rank whole groups (group size "
            f"{group_size}) and whole rotation blocks ({rot}); tensor_parallel_size values "
            f"that work for this layer: {sizes}")


def slice_codes(codes: torch.Tensor, bits: int, in_features: int, rows: tuple[int, int],
                cols: tuple[int, int]) -> torch.Tensor:
    """Packed codes of rows [r0, r1) and columns [c0, c1), packed again for c1 - c0."""
    part = codes[rows[0]:rows[1]]
    if cols == (0, in_features):
        return part.contiguous()
    return pack_codes(unpack_codes(part, bits, in_features)[:, cols[0]:cols[1]], bits)


def slice_scales(scales: torch.Tensor, group_size: int, rows: tuple[int, int],
                 cols: tuple[int, int]) -> torch.Tensor:
    """Scales of rows [r0, r1) and of the groups of columns [c0, c1) (c0 on a group)."""
    g0, g1 = cols[0] // group_size, -(-cols[1] // group_size)
    return scales[rows[0]:rows[1], g0:g1].contiguous()


def slice_outliers(idx: torch.Tensor, val: torch.Tensor, in_features: int,
                   rows: tuple[int, int], cols: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outliers inside rows x cols, re-indexed into the [r1 - r0, c1 - c0] slice.

    Row-major order is kept, so the indices stay ascending as the format requires.
    """
    i = idx.long()
    r, c = i // in_features, i % in_features
    keep = (r >= rows[0]) & (r < rows[1]) & (c >= cols[0]) & (c < cols[1])
    width = cols[1] - cols[0]
    new = (r[keep] - rows[0]) * width + (c[keep] - cols[0])
    return new.to(torch.int32), val[keep]


def slice_rotation(kind: str, material: dict[str, torch.Tensor], in_features: int,
                   cols: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The rotation material a rank needs for its columns [c0, c1) (whole blocks).

    Hadamard: its slice of the signs. Orthogonal: the shared block matrix (when the
    rank holds a full block) and the tail's matrix only on the rank holding the tail.
    """
    if kind == "hadamard":
        return {"signs": material["signs"][cols[0]:cols[1]].contiguous()}
    out = {}
    if "matrix" in material and cols[1] - cols[0] >= material["matrix"].shape[0]:
        out["matrix"] = material["matrix"]
    if "tail" in material and cols[1] == in_features:
        out["tail"] = material["tail"]
    return out


def shard_rows(out_full: int, out_local: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Rows of a column-parallel part on this rank.

    vLLM replicates k/v heads when there are fewer than ranks
    (`QKVParallelLinear.num_kv_head_replicas`): ranks then share a shard.
    """
    if out_local == out_full:
        return 0, out_full
    shards = out_full // out_local
    shard = tp_rank // max(tp_size // shards, 1)
    return shard * out_local, (shard + 1) * out_local

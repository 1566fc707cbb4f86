"""What the manifest says of each converted layer and rotation, as vLLM's side needs it
(module-level dataclasses: the engine pickles them), and the shared rotation material,
read once per process."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tq_kernels.reference import Material


@dataclass(frozen=True)
class LayerInfo:
    """One converted linear layer as vLLM builds it, from the manifest (module-level: the
    engine pickles it)."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    rotation: str | None  # the rotation id, None for "none"
    block: int
    expert: tuple[int, str] | None = None  # (index, role) of one expert of a MoE layer
    col_scale: bool = False  # x is scaled by the stored t before rotation
    tied: bool = False  # a lm_head stored as the input embedding's weight (format 3)

    def spec(self) -> str:
        return (f"{self.bits} bits, group {self.group_size}, rotation "
                f"{self.rotation or 'none'}{', column scales' if self.col_scale else ''}")


@dataclass(frozen=True)
class RotationInfo:
    kind: str
    n: int
    block: int
    keys: dict[str, tuple[str, str]]  # suffix -> (shard file, key)



@functools.lru_cache(maxsize=16)
def rotation_material(folder: str, rid: str, keys: tuple[tuple[str, str, str], ...]
                       ) -> dict[str, torch.Tensor]:
    """A rotation's stored tensors, read once per process (they are shared by layers)."""
    out = {}
    for suffix, shard, key in keys:
        with safe_open(str(Path(folder) / shard), framework="pt", device="cpu") as f:
            out[suffix] = f.get_tensor(key)
    return out


def rank_rotation(folder: str, rid: str, rot: RotationInfo, cols: tuple[int, int],
                  device: torch.device) -> tuple[Material, int]:
    """The shared rotation material cut to the input columns this rank holds
    (tq_cli.vllm_plugin.split), on `device`, with its block size."""
    import tq_cli.vllm_plugin.split as split

    keys = tuple((s, f, k) for s, (f, k) in sorted(rot.keys.items()))
    mat = split.slice_rotation(rot.kind, rotation_material(folder, rid, keys), rot.n, cols)
    mat = {k: t.to(device) for k, t in mat.items()}
    material: Material = (mat["signs"] if rot.kind == "hadamard"
                          else (mat.get("matrix"), mat.get("tail")))
    return material, rot.block

"""Running the model skeleton of `tq calibrate` one transformer block at a time.

The skeleton is built from config.json on the meta device (buffers such as rotary
frequencies real: `tq_cli.runtime.hf_models.build_skeleton`); `BlockWeights`
materialises one block's parameters from the shards and sends them back to meta;
`catch_block_inputs` records what block 0 receives (GPTQ's "catcher", Frantar et al.
2022, arXiv:2210.17323, sec. 5), so each block can then run on its own.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn

from tq_cli.errors import CorruptFileError, UnsupportedError
from tq_cli.io.safetensors_reader import SourceModel, TensorInfo, read_tensor

if TYPE_CHECKING:
    from tq_cli.runtime.module_map import ParamSources


def find_blocks(model: nn.Module, n_layers: int, wanted: set[str]) -> tuple[str, nn.ModuleList]:
    """The block list: the nn.ModuleList of `num_hidden_layers` entries holding the most
    converted modules (found by shape, not by a family's attribute names)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name:
            hits = sum(1 for w in wanted if w.startswith(name + "."))
            if hits and (best is None or hits > best[0]):
                best = (hits, name, mod)
    if best is None:
        raise UnsupportedError(
            f"{type(model).__name__}: no list of {n_layers} blocks holds a converted layer; "
            "tq calibrate needs a stack of transformer blocks")
    return best[1], best[2]


def candidates(name: str, prefix: str) -> list[str]:
    """The same tensor/module under and without the base model's prefix ('model.')."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


class BlockWeights:
    """Moves parameters between the meta device and real tensors read from the shards."""

    def __init__(self, source: SourceModel, prefix: str, device: torch.device,
                 sources: ParamSources | None = None) -> None:
        self.source, self.prefix, self.device = source, prefix, device
        # transformers' renames and expert fusions (tq_cli.runtime.module_map), when known
        self.sources = sources

    def load(self, module: nn.Module, path: str, skip: str = "\0") -> None:
        """Read module's parameters (and any buffer the shards have) outside `skip`."""
        for mname, mod in module.named_modules():
            where = ".".join(x for x in (path, mname) if x)
            if where == skip or where.startswith(skip + "."):
                continue
            for pname, p in list(mod.named_parameters(recurse=False)):
                full = f"{where}.{pname}" if where else pname
                fused = self._fused(full)
                if fused is not None:
                    mod._parameters[pname] = nn.Parameter(fused, requires_grad=False)
                    continue
                info = self._info(full)
                if info is None:
                    raise CorruptFileError(
                        f"{self.source.folder}: no tensor for parameter '{full}' in "
                        "the shards; tq calibrate needs tensor names that match the model's")
                if info.shape != tuple(p.shape):
                    raise CorruptFileError(
                        f"{info.file.name}: tensor '{info.name}' has shape {list(info.shape)}, "
                        f"config.json implies {list(p.shape)}; the folder is inconsistent")
                t = read_tensor(info).to(self.device, torch.float32)
                mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
            for bname, b in list(mod.named_buffers(recurse=False)):
                info = self._info(f"{where}.{bname}")
                if info is not None and info.shape == tuple(b.shape):
                    mod._buffers[bname] = read_tensor(info).to(self.device, b.dtype)

    @staticmethod
    def release(module: nn.Module, keep: nn.Module | None = None) -> None:
        """Parameters back to the meta device (those of `keep` excepted)."""
        kept = set(keep.modules()) if keep is not None else set()
        for mod in module.modules():
            if mod not in kept:
                for pname, p in list(mod.named_parameters(recurse=False)):
                    mod._parameters[pname] = nn.Parameter(p.to("meta"), requires_grad=False)

    def has(self, name: str) -> bool:
        """Whether the shards hold the parameter `name` (under transformers' renames too)."""
        return self._info(name) is not None or self._fused(name) is not None

    def _info(self, name: str) -> TensorInfo | None:
        if self.sources is not None and name in self.sources.direct:
            return self.source.tensors[self.sources.direct[name]]
        return next((self.source.tensors[c] for c in candidates(name, self.prefix)
                     if c in self.source.tensors), None)

    def _fused(self, name: str) -> torch.Tensor | None:
        """A MoE layer's fused experts parameter, stacked from the per-expert tensors."""
        experts = self.sources.fused.get(name) if self.sources is not None else None
        if experts is None:
            return None
        return torch.stack([torch.cat([read_tensor(self.source.tensors[n]) for n in names])
                            for names in experts]).to(self.device, torch.float32)


class _Caught(Exception):
    """Raised by the hook on block 0 once it has seen its inputs."""


def catch_block_inputs(model: nn.Module, block0: nn.Module, seqs: torch.Tensor, batch: int,
           device: torch.device) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) block 0 receives for each batch of sequences."""
    caught: list[tuple[tuple, dict]] = []

    def pre(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        caught.append((args, kwargs))
        raise _Caught

    extra = ({"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters
             else {})
    handle = block0.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for i in range(0, seqs.shape[0], batch):
            try:
                model(input_ids=seqs[i:i + batch].to(device), **extra)
            except _Caught:
                continue
            raise UnsupportedError(f"{type(model).__name__}: the forward pass never reached "
                                   "the first transformer block")
    finally:
        handle.remove()
    return caught


def with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]

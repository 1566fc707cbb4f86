"""One calibration run: the original model, built on the meta device, run one block at a
time, GPTQ-style (Frantar et al. 2022, arXiv:2210.17323, sec. 5 "sequential" processing
with a "catcher" on block 0).

`CalibRun.stages` is a generator: each block is materialised from the shards, runs
every calibration sequence with its converted layers' inputs hooked, hands its outputs on
as the next block's inputs, goes back to meta, and then yields its input groups with
their sums x^T x. The consumer takes each group's sum and drops it: `tq calibrate`
writes it to the calibration file, `tq convert` quantizes the block's tensors from it in
memory (`tq_cli.calibration.stream`) before the next block runs. Memory is one block,
its Hessians and the activations of the calibration set.

Under torchrun each rank runs its own share of the sequences and the sums are
all-reduced (`tq_cli.parallel.Comm`) before a block's groups are yielded. Optional
`BlockStates` keep the inputs of the last blocks on disk, so that an interrupted
conversion resumes at the block it was in instead of running the blocks before it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.calibration.hessian import InputGroup, PlacedLayers, add_hooks
from tq_cli.calibration.skeleton import (
    BlockWeights,
    catch_block_inputs,
    hidden_of,
    with_hidden,
)
from tq_cli.io.safetensors_reader import SourceModel
from tq_cli.parallel import Comm
from tq_cli.runtime.module_map import ParamSources

KEEP_STATES = 2  # inputs of the last blocks kept on disk: a kill while the writer still
# holds the previous block's last tensor resumes from that block


@dataclass
class CalibRun:
    """A model ready to calibrate: the skeleton, its blocks, the placed input groups and
    the token sequences of this rank."""

    model: nn.Module
    source: SourceModel
    prefix: str
    bpath: str
    blocks: nn.ModuleList
    layers: PlacedLayers
    modules: dict[str, nn.Module]
    seqs: torch.Tensor  # [samples, seqlen], all ranks' sequences
    batch: int
    device: torch.device
    meta: dict[str, Any]
    sources: ParamSources | None
    comm: Comm = field(default_factory=Comm)
    # block 0's (args, kwargs) per batch of this rank's sequences (`catch`)
    inputs: list[tuple[tuple, dict]] | None = None

    @property
    def groups(self) -> list[InputGroup]:
        return self.layers.all()

    def block_of(self) -> dict[str, int]:
        """Group key -> the stage that yields it: its block's index, or len(blocks) for
        the tail (a head on the final norm)."""
        out = {g.key: i for i, gs in enumerate(self.layers.blocks) for g in gs}
        out.update((g.key, len(self.blocks)) for g in self.layers.tail)
        return out

    @torch.no_grad()
    def stages(self, needed: set[str] | None = None,
               states: BlockStates | None = None) -> Iterator[tuple[int, list[InputGroup]]]:
        """Yield (stage, groups) per block (and the tail) whose groups hold their sums
        over every rank's tokens. `needed`: the group keys wanted (None: all); blocks
        before the first wanted one run without hooks, or start from `states`, and the
        run stops after the last wanted one."""
        where = self.block_of()
        wanted = [where[k] for k in (needed if needed is not None else where) if k in where]
        if not wanted:
            return
        first, last = min(wanted), max(wanted)
        inputs = self.inputs if self.inputs is not None else self.catch()
        self.inputs = None  # the run's own from here: replaced block by block
        weights = BlockWeights(self.source, self.prefix, self.device, self.sources)
        start = 0
        if states is not None and first > 0:
            found = states.load(min(first, len(self.blocks)), inputs)
            if found is not None:
                start, hidden = found
                inputs = [with_hidden(a, k, h) for (a, k), h in zip(inputs, hidden, strict=True)]
        for i in range(start, min(last, len(self.blocks) - 1) + 1):
            if states is not None and i > start:
                states.save(i, [hidden_of(a, k) for a, k in inputs])
            block = self.blocks[i]
            hooked = i >= first and any(g.key in (needed or where) for g in self.layers.blocks[i])
            weights.load(block, f"{self.bpath}.{i}")
            handles = add_hooks(self.layers.blocks[i], self.modules,
                                [t for t in self.layers.taps
                                 if t.of.startswith(f"{self.bpath}.{i}.")]) if hooked else []
            try:
                for j, (args, kwargs) in enumerate(inputs):
                    for g in self.layers.blocks[i]:
                        g.last = None  # a new batch: nothing is shared with the previous one
                    y = block(*args, **kwargs)
                    y = y[0] if isinstance(y, tuple | list) else y
                    inputs[j] = with_hidden(args, kwargs, y)
            finally:
                for h in handles:
                    h.remove()
            weights.release(block)
            if hooked:
                yield i, self._reduced(self.layers.blocks[i])
        if last == len(self.blocks) and self.layers.tail and self.layers.tail_norm is not None:
            if states is not None and start < len(self.blocks):
                states.save(len(self.blocks), [hidden_of(a, k) for a, k in inputs])
            for args, kwargs in inputs:
                normed = self.layers.tail_norm(hidden_of(args, kwargs))
                for g in self.layers.tail:
                    g.last = None
                    for path in g.members:
                        g.add(path, normed)
            yield len(self.blocks), self._reduced(self.layers.tail)
        if self.layers.tail_norm is not None:
            weights.release(self.layers.tail_norm)

    @torch.no_grad()
    def catch(self) -> list[tuple[tuple, dict]]:
        """Block 0's inputs for this rank's sequences: the base model's weights outside
        the blocks (embeddings, the final norm) read, the model run up to block 0 (a model
        whose forward never gets there is refused here, before any block's work), the
        weights released again but for the final norm."""
        mine = self.seqs[self.comm.share(self.seqs.shape[0])]
        weights = BlockWeights(self.source, self.prefix, self.device, self.sources)
        base: nn.Module = getattr(self.model, "base_model", self.model)
        base_path = next(n for n, m in self.modules.items() if m is base)
        weights.load(base, base_path, skip=self.bpath)
        try:
            self.inputs = catch_block_inputs(self.model, self.blocks[0], mine, self.batch,
                                             self.device)
        finally:
            weights.release(base, keep=self.layers.tail_norm)
        return self.inputs

    def _reduced(self, groups: list[InputGroup]) -> list[InputGroup]:
        """The groups with their sums and counts summed over the ranks."""
        if self.comm.world == 1:
            return groups
        for g in groups:
            h = g.h if g.h is not None else torch.zeros(g.n, g.n, dtype=torch.float32,
                                                        device=self.device)
            g.h = self.comm.all_reduce_(h.cpu() if h.device.type != "cpu" else h)
            counts = torch.tensor([g.tokens, *g.seen.values()], dtype=torch.int64)
            self.comm.all_reduce_(counts)
            g.tokens = int(counts[0])
            g.seen = dict(zip(g.seen, (int(c) for c in counts[1:]), strict=True))
            g.last = None
        return groups


class BlockStates:
    """The inputs of the last `KEEP_STATES` blocks of one rank's calibration run, each a
    safetensors file in `folder`, tagged with what must match to reuse it (the
    calibration's record, the rank and the world size)."""

    def __init__(self, folder: Path, tag: str, comm: Comm) -> None:
        self.folder, self.tag = folder, f"{tag}|rank {comm.rank}/{comm.world}"
        self.rank = comm.rank

    def _path(self, block: int) -> Path:
        return self.folder / f"rank{self.rank}.block{block:05d}.safetensors"

    def save(self, block: int, hidden: list[torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(exist_ok=True)  # in the partial folder, never recreating it
        path = self._path(block)
        tmp = path.with_suffix(".tmp")
        save_file({f"hidden.{j}": h.contiguous().cpu() for j, h in enumerate(hidden)}, tmp,
                  metadata={"tag": self.tag, "block": str(block)})
        tmp.replace(path)
        # this block and the one before it; any other (a later block's, left by an earlier
        # run that got further) would outlive them
        keep = {self._path(b).name for b in range(block - KEEP_STATES + 1, block + 1)}
        for old in self.folder.glob(f"rank{self.rank}.block*.safetensors"):
            if old.name not in keep:
                old.unlink(missing_ok=True)

    def load(self, wanted: int,
             inputs: list[tuple[tuple, dict]]) -> tuple[int, list[torch.Tensor]] | None:
        """(block, inputs of that block) of the latest state at or before `wanted` that
        fits this run, or None."""
        from safetensors import safe_open

        for block in range(wanted, -1, -1):
            path = self._path(block)
            if not path.is_file():
                continue
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("tag") != self.tag or meta.get("block") != str(block):
                        continue
                    hidden = [f.get_tensor(f"hidden.{j}") for j in range(len(inputs))]
            except Exception:  # a damaged or foreign file: run those blocks again
                continue
            want = [hidden_of(a, k) for a, k in inputs]
            if all(h.shape == w.shape and h.dtype == w.dtype for h, w in
                   zip(hidden, want, strict=True)):
                return block, [h.to(w.device) for h, w in zip(hidden, want, strict=True)]
        return None

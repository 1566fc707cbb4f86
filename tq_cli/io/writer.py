"""The checkpoint writer: output shards laid out in full before any compute.

Every output tensor's dtype and shape is known from the plan, so each shard's header
and every tensor's byte offset are fixed up front. Shards are created at full size and
tensors are written at their offsets as they arrive, in any order; a journal records
each finished source tensor with the sha256 of its bytes, which is what `--resume`
verifies. The writer knows nothing about codebooks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tq_cli.io.safetensors_reader import DTYPES, TORCH_TO_ST, TensorInfo, copy_tensor_bytes

JOURNAL = ".tq-journal.jsonl"
RANK_JOURNAL = ".tq-journal.rank"  # + N.jsonl: rank N's, under torchrun


@dataclass(frozen=True)
class Slot:
    """One output tensor: its key, dtype, shape, shard and absolute byte offset."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str
    offset: int


@dataclass
class Layout:
    """Shards in order, each a header and slots; `groups` keep a tensor's keys together."""

    shards: dict[str, list[Slot]] = field(default_factory=dict)
    headers: dict[str, bytes] = field(default_factory=dict)
    slots: dict[str, Slot] = field(default_factory=dict)

    def shard_size(self, shard: str) -> int:
        slots = self.shards[shard]
        return 8 + len(self.headers[shard]) + sum(s.nbytes for s in slots)

    def describe(self) -> list[list]:
        return [[s.key, s.dtype, list(s.shape), s.shard, s.offset] for s in self.slots.values()]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of safetensors `dtype` and `shape`."""
    n = DTYPES[dtype][1]
    for d in shape:
        n *= d
    return n


def plan_layout(groups: list[list[tuple[str, str, tuple[int, ...]]]], max_shard_bytes: int,
                metadata: dict[str, str] | None = None) -> Layout:
    """Pack groups of (key, dtype, shape) into shards of at most max_shard_bytes each.

    A group (all keys of one source tensor) never straddles shards; a group larger than
    the limit gets a shard of its own. Within a shard, tensors are ordered by element
    size, largest first, so every tensor is aligned to its element size.
    """
    bins: list[list[tuple[str, str, tuple[int, ...]]]] = []
    size = 0
    for grp in groups:
        gsize = sum(nbytes(d, s) for _, d, s in grp)
        if not bins or (size + gsize > max_shard_bytes and bins[-1]):
            bins.append([])
            size = 0
        bins[-1].extend(grp)
        size += gsize
    layout = Layout()
    total = len(bins)
    for i, entries in enumerate(bins):
        name = ("model.safetensors" if total == 1
                else f"model-{i + 1:05d}-of-{total:05d}.safetensors")
        entries = sorted(entries, key=lambda e: -DTYPES[e[1]][1])
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        pos = 0
        for key, dtype, shape in entries:
            nb = nbytes(dtype, shape)
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nb]}
            pos += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        start = 8 + len(raw)
        slots = []
        for key, dtype, shape in entries:
            b, _e = header[key]["data_offsets"]  # type: ignore[index]
            slot = Slot(key, dtype, tuple(shape), nbytes(dtype, shape), name, start + b)
            slots.append(slot)
            layout.slots[key] = slot
        layout.shards[name] = slots
        layout.headers[name] = raw
    return layout


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when contiguous."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


class ShardWriter:
    """Writes tensors into pre-laid-out shards in a (temporary) folder, in any order."""

    def __init__(self, folder: Path, layout: Layout) -> None:
        self.folder, self.layout = folder, layout
        self.fds: dict[str, int] = {}

    def open(self, create: bool = True) -> None:
        """Open every shard; with create, also (re)write its header and set its size,
        which leaves tensor bytes already in an existing shard where they are."""
        for name, raw in self.layout.headers.items():
            path = self.folder / name
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            fd = os.open(path, flags, 0o644)
            self.fds[name] = fd
            if create:
                os.ftruncate(fd, self.layout.shard_size(name))
                os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)

    def close(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds.clear()

    def write(self, key: str, tensor: torch.Tensor) -> str:
        """Write one tensor at its slot; returns the sha256 of its bytes."""
        slot = self.layout.slots[key]
        if TORCH_TO_ST.get(tensor.dtype) != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise AssertionError(
                f"{key}: produced {tensor.dtype} {tuple(tensor.shape)}, planned "
                f"{slot.dtype} {slot.shape}")
        data = tensor_bytes(tensor)
        fd = self.fds[slot.shard]
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], slot.offset + done)
        return hashlib.sha256(data).hexdigest()

    def copy(self, key: str, info: TensorInfo,
             should_stop: Callable[[], bool] | None = None) -> str:
        """Copy a source tensor's bytes verbatim into its slot."""
        slot = self.layout.slots[key]
        return copy_tensor_bytes(info, self.fds[slot.shard], slot.offset, should_stop)

    def digest(self, key: str) -> str:
        """sha256 of the bytes now at a slot (what resume checks against the journal)."""
        slot = self.layout.slots[key]
        h = hashlib.sha256()
        done = 0
        while done < slot.nbytes:
            chunk = os.pread(self.fds[slot.shard], min(1 << 26, slot.nbytes - done),
                             slot.offset + done)
            if not chunk:
                break
            h.update(chunk)
            done += len(chunk)
        return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


class Journal:
    """Append-only record of finished source tensors, one JSON object a line. Under
    torchrun each rank appends to its own file; rank 0 reads them all and merges them
    into the one journal (`rewrite`)."""

    def __init__(self, folder: Path, rank: int = 0) -> None:
        self.folder, self.rank = folder, rank
        self.path = folder / (JOURNAL if rank == 0 else f"{RANK_JOURNAL}{rank}.jsonl")

    def _paths(self) -> list[Path]:
        if self.rank != 0:
            return [self.path]
        return [self.path, *sorted(self.folder.glob(f"{RANK_JOURNAL}*.jsonl"))]

    def read(self) -> list[dict]:
        out = []
        for path in self._paths():
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break  # a line cut by a kill: everything after it is redone
        return out

    def rewrite(self, entries: list[dict]) -> None:
        """Replace the journal atomically, e.g. with only the entries that verified (rank
        0: the other ranks' journals are merged into it and removed)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        os.replace(tmp, self.path)
        for path in self._paths()[1:]:
            path.unlink(missing_ok=True)

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

"""A streaming, validating reader of safetensors model folders.

Every header is read and checked before any compute (dtype, shape against byte span,
offsets inside the file, no overlaps, index entries inside the folder), then tensors
are read one at a time with positioned reads, so nothing is memory-mapped and resident
memory stays at one tensor. Messages name the file, the tensor and the fix.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tq_cli.errors import CorruptFileError, SourceError, UnsupportedError
from tq_cli.io.manifest import loads_strict

# safetensors dtype name -> (torch dtype, bytes per element). Explicit; never eval'd.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024
COPY_CHUNK = 64 * 1024 * 1024
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file, absolute offset, length, dtype and shape."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class SourceModel:
    """A validated model folder: its tensors in file order, config and fingerprint."""

    folder: Path
    files: list[Path]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    config: dict | None = None
    fingerprint: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def read_header(path: Path) -> tuple[dict, int, bytes]:
    """Parse and check one safetensors header: (entries, data start offset, raw header)."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(
                    f"{name}: file is too short to be safetensors ({size} bytes); re-download it")
            hlen = int.from_bytes(head, "little")
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CorruptFileError(
                    f"{name}: header length {hlen} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not safetensors, re-download it")
            raw = f.read(hlen)
    except OSError as e:
        raise SourceError(f"{name}: cannot read ({e.strerror})") from e
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError
    except _DuplicateKey as e:
        # the safetensors library refuses such a file; tq would otherwise use the last one
        raise CorruptFileError(f"{name}: the header has the key '{e.key}' twice; the file "
                               "is damaged or was not written by safetensors, re-export it") \
            from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptFileError(f"{name}: header is not valid JSON; re-download the file") from e
    data_start = 8 + hlen
    header.pop("__metadata__", None)
    spans = []
    for tname, entry in header.items():
        if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
            raise CorruptFileError(f"{name}: tensor '{tname}' has a malformed header entry")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise UnsupportedError(
                f"{name}: tensor '{tname}' has dtype '{dtype}', which tq cannot read; "
                f"supported: {', '.join(DTYPES)}")
        def whole(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if (not isinstance(shape, list) or not all(whole(d) and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(whole(o) for o in offs)):
            raise CorruptFileError(
                f"{name}: tensor '{tname}' has a malformed shape or data_offsets; re-download it")
        begin, end = offs
        numel = 1
        for d in shape:
            numel *= d
        want = numel * DTYPES[dtype][1]
        if begin < 0 or end < begin or end - begin != want:
            raise CorruptFileError(
                f"{name}: tensor '{tname}' header says shape {shape} of {dtype} ({want} bytes) "
                f"but data_offsets [{begin}, {end}] span {end - begin}; the file is corrupt, "
                "re-download it")
        if data_start + end > size:
            raise CorruptFileError(
                f"{name}: tensor '{tname}' is truncated (header says it ends at byte "
                f"{data_start + end}, file has {size}); re-download the shard")
        spans.append((begin, end, tname))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in itertools.pairwise(spans):
        if b1 < e0:
            raise CorruptFileError(
                f"{name}: tensors '{n0}' and '{n1}' overlap in the data section; the header "
                "lies about offsets, re-download the file")
    return header, data_start, raw


def _inside(folder: Path, rel: str) -> Path | None:
    """folder/rel if rel stays inside folder as written; symlinks are not resolved, since
    a Hugging Face cache snapshot is a folder of links into its blobs/ folder."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
        return None
    return folder / norm


def _shard_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = folder / INDEX_NAME
    if index.exists():
        try:
            data = json.loads(index.read_text())
            wmap = data["weight_map"]
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptFileError(
                f"{INDEX_NAME}: not a valid index (no weight_map object); re-download it") from e
        files: list[Path] = []
        for tname, rel in wmap.items():
            p = _inside(folder, str(rel))
            if p is None:
                raise CorruptFileError(
                    f"{INDEX_NAME}: weight_map entry for '{tname}' points to '{rel}', outside "
                    "the model folder; refused")
            if not p.is_file():
                raise SourceError(
                    f"{INDEX_NAME}: names shard '{rel}' (for tensor '{tname}'), which is not in "
                    f"{folder}; re-download it")
            if p not in files:
                files.append(p)
        return files, {k: str(v) for k, v in wmap.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files, None
    others = sorted(p.name for p in folder.iterdir() if p.name.endswith(OTHER_WEIGHT_SUFFIXES))
    hint = (f" (found {', '.join(others[:3])}; save it with safe_serialization=True first)"
            if others else "")
    raise SourceError(
        f"{folder}: no model.safetensors or {INDEX_NAME}; tq reads safetensors only{hint}")


def open_source(folder: Path) -> SourceModel:
    """Read and check every header of a model folder; no tensor data is read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"{folder}: no such folder; pass a model folder or a hub id (org/name)")
    files, wmap = _shard_files(folder)
    model = SourceModel(folder=folder, files=files)
    digest = hashlib.sha256()
    for path in files:
        header, data_start, raw = read_header(path)
        digest.update(path.name.encode() + b"\0" + raw)
        # A sample of the data too, so two fine-tunes of one architecture differ.
        size = path.stat().st_size
        with open(path, "rb") as f:
            digest.update(os.pread(f.fileno(), 1 << 20, data_start))
            digest.update(os.pread(f.fileno(), 1 << 20, max(data_start, size - (1 << 20))))
        for tname, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if wmap is not None and wmap.get(tname) is not None and \
                    _inside(folder, wmap[tname]) != path:
                continue
            if tname in model.tensors:
                raise CorruptFileError(
                    f"{path.name}: tensor '{tname}' also appears in "
                    f"{model.tensors[tname].file.name}; the folder mixes two models")
            b, end = e["data_offsets"]
            model.tensors[tname] = TensorInfo(tname, path, e["dtype"], tuple(e["shape"]),
                                              data_start + b, end - b)
    if wmap is not None:
        for tname, rel in wmap.items():
            if tname not in model.tensors:
                raise CorruptFileError(
                    f"{INDEX_NAME}: tensor '{tname}' is listed in '{rel}' but that shard's "
                    "header does not have it; re-download the shard")
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            config = loads_strict(cfg.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptFileError(f"{cfg}: not valid JSON ({e}); re-download it") from e
        if not isinstance(config, dict):
            raise CorruptFileError(f"{cfg}: is JSON but not an object of settings; "
                                   "re-download it")
        model.config = config
        digest.update(cfg.read_bytes())
    model.fingerprint = "sha256:" + digest.hexdigest()
    return model


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The tensor's bytes, read with one positioned read, as a CPU tensor of its dtype."""
    buf = bytearray(info.nbytes)
    got = 0
    with open(info.file, "rb") as f:
        while got < info.nbytes:
            n = os.preadv(f.fileno(), [memoryview(buf)[got:]], info.offset + got)
            if n == 0:
                break
            got += n
    if got != info.nbytes:
        raise CorruptFileError(
            f"{info.file.name}: tensor '{info.name}' is truncated (read {got} of "
            f"{info.nbytes} bytes); re-download the shard")
    dtype = DTYPES[info.dtype][0]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (the same as of its span in the file)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().data if raw.numel() else b"").hexdigest()


def source_sha256(info: TensorInfo) -> str:
    """sha256 of a tensor's span in its file, read in chunks (for --resume checks)."""
    h = hashlib.sha256()
    with open(info.file, "rb") as f:
        done = 0
        while done < info.nbytes:
            chunk = os.pread(f.fileno(), min(COPY_CHUNK, info.nbytes - done), info.offset + done)
            if not chunk:
                raise CorruptFileError(
                    f"{info.file.name}: tensor '{info.name}' is truncated; re-download the shard")
            h.update(chunk)
            done += len(chunk)
    return h.hexdigest()


class CopyInterrupted(Exception):
    """A chunked copy was asked to stop before it finished."""


def copy_tensor_bytes(info: TensorInfo, dest_fd: int, dest_offset: int,
                      should_stop: Callable[[], bool] | None = None) -> str:
    """Copy a tensor's bytes verbatim into dest_fd at dest_offset, in chunks; sha256 of them."""
    h = hashlib.sha256()
    with open(info.file, "rb") as f:
        done = 0
        while done < info.nbytes:
            if should_stop is not None and should_stop():
                raise CopyInterrupted(info.name)
            chunk = os.pread(f.fileno(), min(COPY_CHUNK, info.nbytes - done), info.offset + done)
            if not chunk:
                raise CorruptFileError(
                    f"{info.file.name}: tensor '{info.name}' is truncated; re-download the shard")
            os.pwrite(dest_fd, chunk, dest_offset + done)
            h.update(chunk)
            done += len(chunk)
    return h.hexdigest()


def read_weight(info: TensorInfo) -> torch.Tensor:
    """A source weight in float32 with NaN/Inf as 0, as the pipeline quantizes it under
    --allow-nonfinite (pre-passes that only score tensors never fail on them)."""
    w = read_tensor(info).to(torch.float32)
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w))

"""The calibration file that `tq calibrate` writes and `convert --calib` reads (format v1).

ONE plain safetensors file. Per group of converted tensors that read the same input:
`hessian.<group>` F32 [in, in], the mean E[x x^T] over the calibration tokens, and
`tokens.<group>` I64 [] the token count (sum = mean * count). The safetensors
`__metadata__` key `tq_calibration` holds JSON: format version, tq version, the source
model's fingerprint and name, the text's source and sha256, samples, seqlen, tokens,
the recipe, `tensors` (tensor name -> group key) and `digests` (group key -> sha256 of
its hessian bytes then its tokens bytes, checked when the group is read; files without it
are read unchecked). The layout is fixed before any compute, groups are written at their
offsets as they finish, the digests go into the header last (same length as the
placeholders it was laid out with), and the file appears under its name only when
complete (temporary file + rename in the same folder).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from tq_cli.errors import CorruptFileError, OutputError, SourceError, TqError
from tq_cli.io.safetensors_reader import SourceModel, TensorInfo, read_header, read_tensor
from tq_cli.io.writer import file_sha256, plan_layout, tensor_bytes

FORMAT_VERSION = 1
META_KEY = "tq_calibration"


class CalibrationMismatchError(TqError):
    """A calibration file was made for another model than the one given."""


@dataclass
class Calibration:
    """A calibration file: its metadata, and H per converted tensor on demand."""

    path: Path
    meta: dict[str, Any]
    entries: dict[str, TensorInfo]
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _served: set[str] = field(default_factory=set, repr=False)  # readers of the cached group

    @property
    def tensors(self) -> dict[str, str]:
        """Converted tensor name -> group key (tensors that share an input share a key)."""
        return dict(self.meta["tensors"])

    @cached_property
    def sha256(self) -> str:
        return file_sha256(self.path)

    def tokens(self, tensor_name: str) -> int:
        """Calibration tokens the tensor's input saw (0: none, or not in the file)."""
        key = self.meta["tensors"].get(tensor_name)
        return 0 if key is None else int(read_tensor(self.entries[f"tokens.{key}"]))

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        """E[x x^T] over the calibration tokens, float32 [in, in] as stored: the MEAN, not
        the sum (times `tokens()` gives the sum); a copy the caller owns. None when the
        tensor has no calibration."""
        key = self.meta["tensors"].get(tensor_name)
        if key is None or self.tokens(tensor_name) == 0:
            return None
        if key not in self._cache:
            self._cache.clear()  # q, k, v ask in a row: keep only the last group
            self._served = set()
            h = read_tensor(self.entries[f"hessian.{key}"])
            self._check(key, tensor_name, h)
            self._cache[key] = h.to(torch.float32)
        self._served.add(tensor_name)
        groups = self.meta.get("groups")
        members = groups.get(key) if isinstance(groups, dict) else None
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            members = [tensor_name]  # no usable group list: this reader is the last one
        if self._served.issuperset(members):
            # the group's last reader takes the cached copy itself: no second n x n (a
            # later ask reads the file again)
            return self._cache.pop(key)
        return self._cache[key].clone()

    def _check(self, key: str, tensor_name: str, h: torch.Tensor) -> None:
        want = (self.meta.get("digests") or {}).get(key)  # checked to be a map on opening
        if want is None:
            return  # a file from before digests
        got = _digest(h, int(read_tensor(self.entries[f"tokens.{key}"])))
        if got != want:
            raise CorruptFileError(f"{self.path}: the statistics of '{tensor_name}' (group "
                                   f"'{key}') do not match their digest; the file is "
                                   "damaged, rerun tq calibrate")

    def group(self, tensor_name: str) -> str | None:
        """The key of the tensor's input group (shared by tensors that read one input)."""
        key = self.meta["tensors"].get(tensor_name)
        return str(key) if key is not None else None

    def unusable(self, tensor_name: str) -> str | None:
        """Why the tensor's Hessian is too thin to fit with, or None. An expert of a MoE
        layer sees only the tokens routed to it; with fewer than half as many tokens as
        its inputs, H has rank below n/2 and GPTQ would move the error into directions no
        token probed, so that expert gets the weight-only fit."""
        routed = self.__dict__.get("_routed")
        if routed is None:  # a set once: a large MoE has tens of thousands of experts' tensors
            routed = self.__dict__["_routed"] = frozenset(self.meta.get("routed", ()))
        if tensor_name not in routed:
            return None
        key = self.meta["tensors"][tensor_name]
        n = self.entries[f"hessian.{key}"].shape[0]
        seen = self.tokens(tensor_name)
        if 0 < seen < n / 2:
            return (f"an expert routed {seen} calibration tokens, fewer than half its {n} "
                    "inputs")
        return None

    def check_source(self, source: SourceModel) -> None:
        """Refuse a calibration made for another model (the fingerprints differ)."""
        made = self.meta["source"]
        if made["fingerprint"] != source.fingerprint:
            raise CalibrationMismatchError(
                f"{self.path}: made for model '{made['name']}' ({_short(made['fingerprint'])}), "
                f"not for the model given, '{source.folder.name}' "
                f"({_short(source.fingerprint)}); run tq calibrate on {source.folder}")
        for tname, key in self.meta["tensors"].items():
            info = source.tensors.get(tname)
            h = self.entries[f"hessian.{key}"]
            if info is not None and len(info.shape) == 2 and h.shape[0] != info.shape[1]:
                raise CalibrationMismatchError(
                    f"{self.path}: the statistics for '{tname}' are {h.shape[0]} wide, but "
                    f"the tensor has {info.shape[1]} input columns; the file is damaged, "
                    f"rerun tq calibrate on {source.folder}")


def _short(fingerprint: str) -> str:
    return fingerprint.removeprefix("sha256:")[:12]


def read_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Open and check a calibration file; no H is read until asked for."""
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{p}: no such calibration file; make one with tq calibrate")
    try:
        header, start, raw = read_header(p)
    except CorruptFileError as e:
        raise CorruptFileError(f"{p}: damaged or not a calibration file ({e}); rerun "
                               "tq calibrate") from None
    try:
        meta = json.loads(json.loads(raw)["__metadata__"][META_KEY])
    except (KeyError, TypeError, ValueError, RecursionError):
        raise CorruptFileError(f"{p}: not a tq calibration file (no '{META_KEY}' metadata); "
                               "make one with tq calibrate") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if not isinstance(version, int):
        raise CorruptFileError(f"{p}: calibration metadata has no format_version; the file is "
                               "damaged, rerun tq calibrate")
    if version > FORMAT_VERSION:
        raise TqError(f"{p}: calibration format version {version} is newer than this tq reads "
                      f"({FORMAT_VERSION}); upgrade tq")
    entries = {name: TensorInfo(name, p, e["dtype"], tuple(e["shape"]),
                                start + e["data_offsets"][0],
                                e["data_offsets"][1] - e["data_offsets"][0])
               for name, e in header.items()}
    try:
        if not isinstance(meta["source"]["fingerprint"], str):
            raise KeyError("source.fingerprint")
        digests = meta.get("digests")
        if digests is not None and (not isinstance(digests, dict) or not all(
                isinstance(v, str) and len(v) == 64 for v in digests.values())):
            raise KeyError("digests")
        for tname, key in meta["tensors"].items():
            h, n = entries[f"hessian.{key}"], entries[f"tokens.{key}"]
            if len(h.shape) != 2 or h.shape[0] != h.shape[1] or h.dtype != "F32" or \
                    n.dtype != "I64" or n.numel != 1:
                raise KeyError(tname)
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptFileError(f"{p}: calibration entry {e} is missing or malformed; the "
                               "file is damaged, rerun tq calibrate") from None
    return Calibration(p, meta, entries)


def check_out(out: Path, source: SourceModel) -> None:
    """Refuse OUT inside the source folder (a stray *.safetensors there could be read as
    a shard), a folder, or an existing file that is not a calibration file."""
    src, parent = source.folder.resolve(), out.parent.resolve()
    if parent == src or src in parent.parents:
        raise OutputError(f"{out}: is inside the source model folder {source.folder}; write "
                          "the calibration file elsewhere")
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; pass a file path for the calibration")
    if out.exists():
        try:
            read_calibration(out)
        except TqError:
            raise OutputError(f"{out}: exists and is not a tq calibration file; remove it or "
                              "choose another path") from None


def _digest(h: torch.Tensor, tokens: int) -> str:
    """sha256 of a group's stored bytes: its float32 mean, then its int64 token count."""
    d = hashlib.sha256(tensor_bytes(h.float().contiguous()))
    d.update(tokens.to_bytes(8, "little", signed=True))
    return d.hexdigest()


class CalibrationWriter:
    """Lays the file out up front, writes groups as they finish, renames it into place."""

    def __init__(self, out: Path, groups: dict[str, int], meta: dict[str, Any]) -> None:
        self.out = out
        self.tmp = out.parent / f".{out.name}.tq-partial"
        self._groups, self._meta = groups, meta
        self.digests = {k: "0" * 64 for k in groups}  # filled in as groups are written
        self.layout = self._layout()
        [(self._shard, self._header)] = self.layout.headers.items()
        self.size = self.layout.shard_size(self._shard)
        self.fd = -1

    def _layout(self) -> Any:
        return plan_layout(
            [[(f"hessian.{k}", "F32", (n, n)), (f"tokens.{k}", "I64", ())]
             for k, n in self._groups.items()], 1 << 62,
            metadata={META_KEY: json.dumps({**self._meta, "digests": self.digests,
                                            "format_version": FORMAT_VERSION},
                                           sort_keys=True)})

    def __enter__(self) -> CalibrationWriter:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.size)
        self._pwrite(len(self._header).to_bytes(8, "little") + self._header, 0)
        return self

    def write(self, key: str, h_sum: torch.Tensor, tokens: int) -> None:
        """Store the mean h_sum / tokens as float32 and the count (zeros when no tokens)."""
        mean = (h_sum.float() / max(tokens, 1)).cpu()  # one float32 n x n beside the sum
        self._pwrite(tensor_bytes(mean), self.layout.slots[f"hessian.{key}"].offset)
        self._pwrite(tokens.to_bytes(8, "little", signed=True),
                     self.layout.slots[f"tokens.{key}"].offset)
        self.digests[key] = _digest(mean, tokens)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                # the digests into the header: same keys, same-length values, same offsets
                [(_, header)] = self._layout().headers.items()
                if len(header) != len(self._header):
                    raise RuntimeError("calibration header changed length")
                self._pwrite(len(header).to_bytes(8, "little") + header, 0)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        if exc_type is None:
            os.replace(self.tmp, self.out)
        else:  # never leave a half file behind
            self.tmp.unlink(missing_ok=True)

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

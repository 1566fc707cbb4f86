"""Reading a tq checkpoint back: manifest, checksums, and quantized tensors.

Used by the loader, by `tq eval` and by tests. Opening one runs the structural checks
of `tq_cli.io.integrity` (schema, manifest digest, index and every shard header against
the manifest), so no tensor is read from a folder that is not what `convert` wrote; it
then rebuilds `QuantizedTensor`s and rotation material from the stored keys.
"""

from __future__ import annotations

import contextvars
import json
from pathlib import Path

import torch
from safetensors import safe_open

from tq_cli.errors import CorruptFileError, TqError
from tq_cli.io.format import COL_SCALE, ROTATION_PREFIX, ConvertedEntry, converted_entries
from tq_cli.io.integrity import verify_checkpoint, verify_shard_checksums
from tq_cli.io.manifest import read_manifest
from tq_cli.io.safetensors_reader import INDEX_NAME
from tq_cli.quant.grouped import QuantizedTensor
from tq_cli.quant.rotation import Rotation, rotation_from_tensors, verify


class Checkpoint:
    """A tq folder: its manifest, and lazy access to its tensors by key."""

    def __init__(self, folder: str | Path, verify_checksums: bool = False) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        verify_checkpoint(self.folder, self.manifest, checksums=verify_checksums)
        self.entries = {t["name"]: t for t in self.manifest["tensors"]}
        self.converted: dict[str, ConvertedEntry] = {
            e.name: e for e in converted_entries(self.manifest)}
        index = json.loads((self.folder / INDEX_NAME).read_text(encoding="utf-8"))
        self._where: dict[str, str] = dict(index["weight_map"])
        self._rotations: dict[str, Rotation] = {}

    def verify_checksums(self) -> None:
        """Compare each shard's sha256 with the manifest; raise naming the first bad one."""
        verify_shard_checksums(self.folder, self.manifest["shards"])

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise CorruptFileError(f"{self.folder}: tensor '{key}' is missing from every shard")
        with safe_open(str(self.folder / self._where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def rotation(self, rid: str) -> Rotation:
        if rid not in self._rotations:
            info = self.manifest["rotations"][rid]
            mats = {k.rsplit(".", 1)[1]: self.tensor(k) for k in info["keys"]}
            self._rotations[rid] = rotation_from_tensors(info["kind"], info["n"], info["block"],
                                                         info["seed"], mats)
        return self._rotations[rid]

    def quantized(self, name: str) -> QuantizedTensor:
        e = self.converted.get(name)
        if e is None:
            raise TqError(f"{self.folder}: tensor '{name}' is not a converted tensor here")
        rot = (self.rotation(e.rotation_id) if e.rotation_id
               else Rotation("none", e.shape[1], e.block, e.seed))
        stored = {suffix: self.tensor(key) for suffix, key in e.keys.items()}
        return QuantizedTensor(
            shape=e.shape, spec=e.spec, rotation=rot,
            codes=stored["codes"], scales=stored["scales"], codebook=stored["codebook"],
            outlier_idx=stored["outlier_idx"], outlier_val=stored["outlier_val"],
            rel_error=e.rel_error if e.rel_error is not None else float("nan"),
            col_scale=stored.get(COL_SCALE),
        )

    def rotation_keys(self) -> list[str]:
        return [k for k in self._where if k.startswith(ROTATION_PREFIX)]


# Folders already checked in this process, with the file stats they were checked at, so
# tq_cli.load and the from_pretrained it calls verify a folder once, and again if it changes.
# The stats include the inode and the change time (ctime): a file edited in place and given
# back its old modification time (os.utime) still has a new ctime, which no call can set.
_VERIFIED: dict[Path, tuple[tuple[str, int, int, int, int], ...]] = {}


def _stats(folder: Path) -> tuple[tuple[str, int, int, int, int], ...]:
    out = []
    for p in sorted(folder.iterdir()):
        if p.is_file():
            st = p.stat()
            out.append((p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


# Set by tq_cli.load(..., verify_checksums=False) around its from_pretrained call, so the
# quantizer's own check of the same folder skips the checksums too (it is this context's
# choice, not the process's: another load in another thread still verifies).
SKIP_CHECKSUMS: contextvars.ContextVar[bool] = contextvars.ContextVar("tq_skip_checksums",
                                                                      default=False)


def check_checkpoint(folder: Path, verify_checksums: bool = True) -> Checkpoint:
    """Every integrity check before a load: the structure (tq_cli.io.integrity), the sha256
    of every shard (unless verify_checksums is False) and the rotation material against a
    fresh draw from its seed. Raises TqError naming the problem."""
    folder = Path(folder).resolve()
    verify_checksums = verify_checksums and not SKIP_CHECKSUMS.get()
    stats = _stats(folder)
    checksums = verify_checksums and _VERIFIED.get(folder) != stats
    # from_pretrained calls this under a meta default device; the checks need real tensors.
    with torch.device("cpu"):
        ck = Checkpoint(folder, verify_checksums=checksums)
        for rid, info in ck.manifest.get("rotations", {}).items():
            if not verify(ck.rotation(rid)):
                raise CorruptFileError(
                    f"{folder}: rotation material '{rid}' does not match its seed "
                    f"{info['seed']}; the checkpoint was altered or made by an incompatible "
                    "tq")
    if verify_checksums:
        _VERIFIED[folder] = stats
    return ck

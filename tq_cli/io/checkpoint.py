"""Reading a format-v1 checkpoint back: manifest, checksums, and quantized tensors.

Used by the loader, by `tq eval` and by tests; it rebuilds `QuantizedTensor`s from the
stored keys and the manifest, and rotation material from its shared keys.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tq_cli.errors import CorruptFileError, TqError
from tq_cli.io.manifest import read_manifest
from tq_cli.io.writer import file_sha256
from tq_cli.quantizer import QuantizedTensor
from tq_cli.rotation import ROTATION_PREFIX, Rotation, rotation_from_tensors
from tq_cli.spec import QuantSpec


class Checkpoint:
    """A tq folder: its manifest, and lazy access to its tensors by key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.entries = {t["name"]: t for t in self.manifest["tensors"]}
        self._where: dict[str, str] = {}
        for shard in self.manifest["shards"]:
            path = self.folder / shard
            if not path.is_file():
                raise CorruptFileError(f"{path}: shard named in the manifest is missing")
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[key] = shard
        self._rotations: dict[str, Rotation] = {}

    def verify_checksums(self) -> None:
        """Compare each shard's sha256 with the manifest; raise naming the first bad one."""
        for shard, want in self.manifest["shards"].items():
            got = file_sha256(self.folder / shard)
            if got != want:
                raise CorruptFileError(
                    f"{self.folder / shard}: checksum mismatch (manifest {want[:12]}…, file "
                    f"{got[:12]}…); the shard is damaged, convert again or re-download it")

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
        e = self.entries.get(name)
        if e is None or e["action"] != "quantize":
            raise TqError(f"{self.folder}: tensor '{name}' is not a converted tensor here")
        rot_info = e["rotation"]
        out, n = e["shape"]
        rot = (self.rotation(rot_info["id"]) if rot_info["id"]
               else Rotation("none", n, rot_info["block"], rot_info["seed"]))
        return QuantizedTensor(
            shape=(out, n), spec=QuantSpec(**e["spec"]), rotation=rot,
            codes=self.tensor(f"{name}.codes"), scales=self.tensor(f"{name}.scales"),
            codebook=self.tensor(f"{name}.codebook"),
            outlier_idx=self.tensor(f"{name}.outlier_idx"),
            outlier_val=self.tensor(f"{name}.outlier_val"),
            rel_error=e["rel_error"],
        )

    def rotation_keys(self) -> list[str]:
        return [k for k in self._where if k.startswith(ROTATION_PREFIX)]

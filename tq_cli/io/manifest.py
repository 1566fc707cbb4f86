"""`tq_manifest.json` and the `quantization_config` of config.json (tq_cli.io.format).

The manifest is plain JSON: format and tq versions, the source fingerprint, the
recipe and specs, per tensor what was done and where it is stored, and a sha256 per
output shard. Readers refuse a newer format version by name. The format's names and
versions are tq_cli.io.format's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tq_cli.errors import TqError
from tq_cli.io.format import MANIFEST, QUANT_METHOD, check_format_version

__all__ = ["NotACheckpointError", "loads_strict", "quantization_config", "read_manifest",
           "write_json"]


class NotACheckpointError(TqError):
    """The folder is not a tq checkpoint."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, which Python's json accepts by default."""
    return json.loads(text, parse_constant=_no_constant)


def read_manifest(folder: Path) -> dict:
    """The manifest of a tq folder, checked for a format version this tq can read."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise NotACheckpointError(
            f"{folder}: not a tq checkpoint (no {MANIFEST}); convert it with `tq convert`")
    try:
        data = loads_strict(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise NotACheckpointError(f"{path}: not valid JSON; the checkpoint is damaged") from e
    if not isinstance(data, dict):
        raise NotACheckpointError(f"{path}: not a JSON object; the checkpoint is damaged")
    version = data.get("format_version")
    if not isinstance(version, int):
        raise NotACheckpointError(f"{path}: no format_version; the checkpoint is damaged")
    check_format_version(path, version)
    return data


def quantization_config(quant: dict, rotation: dict, block: int | None,
                        kept_modules: list[str], version: int,
                        head_bits: int | None = None) -> dict:
    """The config.json entry that marks a folder as a TurboQuant checkpoint; `finish` adds
    the manifest's digest (tq_cli.io.integrity.manifest_digest) for readers to check.
    `head_bits`: lm_head stored quantized at these bits (tq_cli.quant.head)."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": version,
        "bits": quant["bits"],
        "group_size": quant["group_size"],
        "codebook": quant["codebook"],
        "outliers": quant["outliers"],
        "col_scale": quant.get("col_scale", "none"),
        "rotation": rotation["kind"],
        "rotation_block": block,
        "seed": rotation["seed"],
        "modules_to_not_convert": kept_modules,
    } | ({"head_bits": head_bits} if head_bits is not None else {})


def write_json(path: Path, data: dict) -> None:
    """Strict JSON: a NaN or infinity is a bug to surface, never `NaN` in a file."""
    path.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")

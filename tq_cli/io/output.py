"""The output folder of a conversion: checks, the partial folder, resume, the final swap.

A conversion writes into a hidden partial folder beside OUT (`.OUT.tq-partial`) and
renames it into place only when it is complete, so an interrupted run never leaves a
folder that looks finished, and an existing OUT is removed only after the new one is
whole. `verified` decides which tensors a resumed run may keep.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tq_cli.errors import OutputError
from tq_cli.io.manifest import MANIFEST
from tq_cli.io.safetensors_reader import INDEX_NAME, OTHER_WEIGHT_SUFFIXES
from tq_cli.io.writer import Journal, ShardWriter

PLAN_FILE = ".tq-plan.json"


def partial_path(out: Path) -> Path:
    return out.parent / f".{out.name}.tq-partial"


def check_output(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an OUT that would lose or corrupt anything the user has."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise OutputError(f"{out}: is inside the source folder {source}; choose another OUT")
    if dst in src.parents:
        raise OutputError(f"{out}: contains the source folder {source}; choose another OUT")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise OutputError(f"{out}: already exists; pass --overwrite to replace it "
                          "(the old folder is kept until the new one is complete)")
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder; remove it or choose another OUT")
    if any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise OutputError(f"{out}: exists and is not a tq checkpoint; --overwrite only "
                          "replaces a tq checkpoint or an empty folder, so remove it by hand "
                          "or choose another OUT")


def read_plan_hash(partial: Path) -> str | None:
    try:
        return json.loads((partial / PLAN_FILE).read_text()).get("plan_hash")
    except (OSError, ValueError):
        return None


def verified(journal: Journal, writer: ShardWriter) -> dict[str, dict]:
    """Journal entries whose bytes on disk still match their recorded digests."""
    ok: dict[str, dict] = {}
    for entry in journal.read():
        digests = entry.get("digests", {})
        if digests and all(k in writer.layout.slots and writer.digest(k) == d
                           for k, d in digests.items()):
            ok[entry["tensor"]] = entry
    return ok


def copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer and other non-weight files, copied; weights and the old card are not."""
    skip = {"config.json", INDEX_NAME, "README.md", MANIFEST}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if str(rel) in skip or path.suffix == ".safetensors" or \
                path.name.endswith(OTHER_WEIGHT_SUFFIXES):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished folder to OUT; an old OUT is removed only after that."""
    old = out.parent / f".{out.name}.tq-old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.rename(out, old)
    os.rename(partial, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old.exists():
        shutil.rmtree(old)

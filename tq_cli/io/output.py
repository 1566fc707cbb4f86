"""The output folder of a conversion: checks, the partial folder, resume, the final swap.

A conversion writes into a hidden partial folder beside OUT (`.OUT.tq-partial`) and
renames it into place only when it is complete, so an interrupted run never leaves a
folder that looks finished, and an existing OUT is removed only after the new one is
whole. `verified` decides which tensors a resumed run may keep.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tq_cli.errors import OutputError, TqError
from tq_cli.io.format import MANIFEST
from tq_cli.io.manifest import read_manifest
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
    if not any(out.iterdir()):
        return
    how = ("--overwrite only replaces a tq checkpoint or an empty folder, so remove it by "
           "hand or choose another OUT")
    if not (out / MANIFEST).is_file():
        raise OutputError(f"{out}: exists and is not a tq checkpoint; {how}")
    try:
        manifest = read_manifest(out)
        shards = manifest["shards"]
        listed = manifest.get("files")
        if not isinstance(shards, dict) or not isinstance(listed, list | None):
            raise TypeError
    except (TqError, KeyError, TypeError):
        raise OutputError(f"{out}: its {MANIFEST} is not a tq manifest; {how}") from None
    allowed = {MANIFEST, INDEX_NAME, "config.json", "README.md", *map(str, shards),
               *map(str, listed or [])}
    unexpected = []
    for path in sorted(out.rglob("*")):
        rel = str(path.relative_to(out))
        if path.is_dir() or rel in allowed:
            continue
        # A checkpoint from a tq that did not list its copied files: the same file in the
        # source is a copy convert made, anything else belongs to the user.
        if listed is None and (source / rel).is_file() and not path.is_symlink():
            continue
        unexpected.append(rel)
    if unexpected:
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise OutputError(f"{out}: holds files tq did not write ({', '.join(unexpected[:3])}"
                          f"{more}); {how}")


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an OS lock on OUT for a whole conversion, so a second `tq convert` into the
    same OUT stops at once instead of mixing its shards with ours. The lock is a file
    beside OUT (`.OUT.tq-lock`), released by the OS if the process dies."""
    for parent in out.absolute().parents:  # the nearest one that exists must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{out}: {parent} is a file, not a folder; choose another "
                                  "OUT")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out.parent}: cannot create the folder for OUT ({e.strerror}); "
                          "choose another OUT") from e
    path = out.parent / f".{out.name}.tq-lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"{path}: cannot create the lock file ({e.strerror}); choose "
                              "another OUT") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{out}: another tq convert (pid {holder}) is writing it now; "
                              "wait for it to finish or choose another OUT") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and lock: try again
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


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


def copy_other_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer and other non-weight files, copied (weights and the old card are not);
    returns their relative paths, which the manifest lists."""
    skip = {"config.json", INDEX_NAME, "README.md", MANIFEST}
    copied = []
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
        copied.append(str(rel))
    return copied


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the
    system or file system cannot, and nothing was changed."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return int(fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)) == 0


def swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished folder to OUT; an old OUT is removed only after that. Where the
    system can, the two are exchanged in one step, so that OUT never stops existing: a
    reader finds the old folder or the new one (tq_cli.load reads again a folder replaced
    while it loaded)."""
    old = out.parent / f".{out.name}.tq-old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists() and exchange(partial, out):
        try:
            os.rename(partial, old)  # the old checkpoint, under the name removed below
        except OSError:  # OUT is the new checkpoint already: the old one just goes
            shutil.rmtree(partial, ignore_errors=True)
    else:
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

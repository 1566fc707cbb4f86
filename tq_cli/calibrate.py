"""Calibration: per-layer input second moments H = E[x x^T] from running the model on text.

The original model runs one transformer block at a time, GPTQ-style (Frantar et al.
2022, arXiv:2210.17323, sec. 5 "sequential" processing with a "catcher" on block 0):
the skeleton is built from config.json on the meta device (buffers such as rotary
frequencies real), only the embeddings are read from the shards, the arguments block 0
receives are caught, and then each block is materialised from the shards, runs every
calibration sequence, hands its outputs on as the next block's inputs, and goes back
to meta. Memory is one block plus the activations of the calibration set.

Each converted linear layer's input feeds a float64 accumulator (per-batch x^T x in
float32, added in float64); layers that read the same input (the recipe's
`input_groups`: q/k/v, gate/up) share one. The result is ONE safetensors file:
`hessian.<group>` (float32 mean E[x x^T]) and `tokens.<group>` (int64 count), and
JSON in the `tq_calibration` metadata key (docs/format.md). `tq convert --calib` and
`tq search-seed --objective calib` read it back with `read_calibration`.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from tq_cli import __version__
from tq_cli.errors import CorruptFileError, SourceError, TqError, UnsupportedError
from tq_cli.io.calibration import (
    Calibration,
    CalibrationMismatchError,
    CalibrationWriter,
    check_out,
    read_calibration,
)
from tq_cli.io.safetensors_reader import SourceModel, TensorInfo, open_source, read_tensor
from tq_cli.recipe import Recipe
from tq_cli.text import Text

__all__ = ["CalibResult", "CalibSpec", "Calibration", "CalibrationMismatchError", "calibrate",
           "read_calibration", "token_sequences"]
Progress = Callable[[int, int], None]
Warn = Callable[[str], None]


class CalibSpec(BaseModel):
    """What `calibrate` runs: the text (None: the embedded calibration split) and its cut."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str | None = None
    samples: int = Field(128, ge=1, description="sequences of `seqlen` tokens")
    seqlen: int = Field(512, ge=2, description="tokens per sequence")
    device: Literal["auto", "cpu", "cuda"] = "auto"
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
        raise TqError(f"{text.source}: only {ids.numel()} tokens, fewer than one sequence of "
                      f"--seqlen {seqlen}; pass a longer --text or a smaller --seqlen")
    if fit < samples and warn is not None:
        warn(f"{text.source}: {ids.numel()} tokens make only {fit} sequences of {seqlen} "
             f"(asked for {samples}); calibrating on {fit * seqlen} tokens. Pass a longer "
             "--text for more")
    n = min(fit, samples)
    return ids[: n * seqlen].reshape(n, seqlen)


# ---------------------------------------------------------------- the model skeleton


def build_skeleton(folder: Path, config: dict) -> nn.Module:
    """The model from config.json: parameters on meta, buffers (rotary tables) real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from tq_cli.loader import model_class

    cls = model_class(config)
    cfg = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        build = cls._from_config if hasattr(cls, "_from_config") else cls.from_config
        model = build(cfg, dtype=torch.float32)
    return model.eval()


def find_blocks(model: nn.Module, n_layers: int, wanted: set[str]) -> tuple[str, nn.ModuleList]:
    """The block list: the nn.ModuleList of `num_hidden_layers` entries holding the most
    converted modules (found by shape, not by a family's attribute names)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name:
            hits = sum(1 for w in wanted if w.startswith(name + "."))
            if hits and (best is None or hits > best[0]):
                best = (hits, name, mod)
    if best is None:
        raise UnsupportedError(
            f"{type(model).__name__}: no list of {n_layers} blocks holds a converted layer; "
            "tq calibrate needs a stack of transformer blocks")
    return best[1], best[2]


def _candidates(name: str, prefix: str) -> list[str]:
    """The same tensor/module under and without the base model's prefix ('model.')."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


class _Weights:
    """Moves parameters between the meta device and real tensors read from the shards."""

    def __init__(self, source: SourceModel, prefix: str, device: torch.device) -> None:
        self.source, self.prefix, self.device = source, prefix, device

    def load(self, module: nn.Module, path: str, skip: str = "\0") -> None:
        """Read module's parameters (and any buffer the shards have) outside `skip`."""
        for mname, mod in module.named_modules():
            where = ".".join(x for x in (path, mname) if x)
            if where == skip or where.startswith(skip + "."):
                continue
            for pname, p in list(mod.named_parameters(recurse=False)):
                info = self._info(f"{where}.{pname}")
                if info is None:
                    raise CorruptFileError(
                        f"{self.source.folder}: no tensor for parameter '{where}.{pname}' in "
                        "the shards; tq calibrate needs tensor names that match the model's")
                if info.shape != tuple(p.shape):
                    raise CorruptFileError(
                        f"{info.file.name}: tensor '{info.name}' has shape {list(info.shape)}, "
                        f"config.json implies {list(p.shape)}; the folder is inconsistent")
                t = read_tensor(info).to(self.device, torch.float32)
                mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
            for bname, b in list(mod.named_buffers(recurse=False)):
                info = self._info(f"{where}.{bname}")
                if info is not None and info.shape == tuple(b.shape):
                    mod._buffers[bname] = read_tensor(info).to(self.device, b.dtype)

    @staticmethod
    def release(module: nn.Module, keep: nn.Module | None = None) -> None:
        """Parameters back to the meta device (those of `keep` excepted)."""
        kept = set(keep.modules()) if keep is not None else set()
        for mod in module.modules():
            if mod not in kept:
                for pname, p in list(mod.named_parameters(recurse=False)):
                    mod._parameters[pname] = nn.Parameter(p.to("meta"), requires_grad=False)

    def _info(self, name: str) -> TensorInfo | None:
        return next((self.source.tensors[c] for c in _candidates(name, self.prefix)
                     if c in self.source.tensors), None)


# ---------------------------------------------------------------- accumulation


class _Group:
    """One H = sum x x^T, shared by the modules that read the same input."""

    def __init__(self, key: str, members: dict[str, str], n: int) -> None:
        self.key, self.members, self.n = key, members, n  # members: module path -> tensor
        self.h: torch.Tensor | None = None
        self.tokens = 0
        self.seen = dict.fromkeys(members, 0)
        self.last: torch.Tensor | None = None

    def add(self, member: str, x: torch.Tensor) -> None:
        rows = x.numel() // self.n
        self.seen[member] += rows
        last = self.last
        if last is not None and (last is x or (last.shape == x.shape and torch.equal(last, x))):
            return  # a sibling already counted this very input
        self.last = x
        x2 = x.detach().reshape(rows, self.n).float()
        if self.h is None:
            self.h = torch.zeros(self.n, self.n, dtype=torch.float64, device=x.device)
        # float32 product per batch (BLAS speed), float64 accumulation across batches.
        self.h += (x2.T @ x2).double()
        self.tokens += rows

    def check(self, recipe: Recipe) -> None:
        if any(v != self.tokens for v in self.seen.values()):
            raise UnsupportedError(
                f"recipe '{recipe.name}': input_groups puts {', '.join(self.members)} together, "
                f"but they read different inputs ({self.seen}); fix input_groups")


def _group_key(module: str, converted: set[str], recipe: Recipe) -> tuple[str, list[str]]:
    parent, _, leaf = module.rpartition(".")
    for grp in recipe.input_groups:
        if leaf in grp:
            sibs = [m for m in grp if (f"{parent}.{m}" if parent else m) in converted]
            return (f"{parent}.{'+'.join(sibs)}" if parent else "+".join(sibs)), sibs
    return module, [leaf]


@dataclass
class _Layers:
    """Converted tensors placed in the model: groups per block, the tail, the rest."""

    blocks: list[list[_Group]]
    tail: list[_Group]
    tail_norm: nn.Module | None
    uncalibrated: dict[str, str]  # tensor -> reason

    def all(self) -> list[_Group]:
        return [g for gs in self.blocks for g in gs] + self.tail


def place_layers(model: nn.Module, names: list[str], recipe: Recipe, prefix: str,
                 bpath: str, n_blocks: int) -> _Layers:
    """Map converted tensor names to modules and group them by block and shared input."""
    modules = dict(model.named_modules())
    found: dict[str, str] = {}  # module path -> tensor name
    out = _Layers([[] for _ in range(n_blocks)], [], None, {})
    for name in names:
        base = name.removesuffix(".weight")
        path = next((c for c in _candidates(base, prefix) if c in modules), None)
        if not name.endswith(".weight") or path is None:
            out.uncalibrated[name] = "no module of that name in the model"
        elif not isinstance(modules[path], nn.Linear):
            out.uncalibrated[name] = f"{type(modules[path]).__name__} is not nn.Linear"
        else:
            found[path] = name
    parent_path = bpath.rpartition(".")[0]
    parent = modules[parent_path] if parent_path else model
    kids = list(parent.named_children())
    after = [m for n, m in kids[[n for n, _ in kids].index(bpath.rpartition(".")[2]) + 1:]
             if any(True for _ in m.parameters())]
    if len(after) == 1 and "norm" in type(after[0]).__name__.lower():
        out.tail_norm = after[0]
    groups: dict[str, _Group] = {}
    for path in found:
        key, sibs = _group_key(path, set(found), recipe)
        if key in groups:
            continue
        parent_of = path.rpartition(".")[0]
        members = {m: found[m] for m in (f"{parent_of}.{s}" if parent_of else s for s in sibs)}
        widths = {int(modules[m].in_features) for m in members}
        if len(widths) != 1:
            raise UnsupportedError(f"recipe '{recipe.name}': input_groups puts {list(members)} "
                                   "together but their input widths differ; fix input_groups")
        g = groups[key] = _Group(key, members, widths.pop())
        if path.startswith(bpath + "."):
            out.blocks[int(path[len(bpath) + 1:].split(".")[0])].append(g)
        elif "." in path:  # inside the base model, or deep in a head: inputs unknown
            for m in members.values():
                out.uncalibrated[m] = "outside the blocks and not a head on the final norm"
        elif out.tail_norm is None:
            for m in members.values():
                out.uncalibrated[m] = "no final norm after the blocks was recognised"
        else:  # a head such as lm_head reads norm(last block's output)
            out.tail.append(g)
    return out


def _hooks(groups: list[_Group], modules: dict[str, nn.Module]) -> list[Any]:
    handles = []
    for g in groups:
        for path in g.members:
            def pre(_mod: nn.Module, args: tuple, g: _Group = g, path: str = path) -> None:
                g.add(path, args[0])
            handles.append(modules[path].register_forward_pre_hook(pre))
    return handles


class _Caught(Exception):
    """Raised by the hook on block 0 once it has seen its inputs."""


def _catch(model: nn.Module, block0: nn.Module, seqs: torch.Tensor, batch: int,
           device: torch.device) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) block 0 receives for each batch of sequences."""
    caught: list[tuple[tuple, dict]] = []

    def pre(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        caught.append((args, kwargs))
        raise _Caught

    extra = ({"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters
             else {})
    handle = block0.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for i in range(0, seqs.shape[0], batch):
            try:
                model(input_ids=seqs[i:i + batch].to(device), **extra)
            except _Caught:
                continue
            raise UnsupportedError(f"{type(model).__name__}: the forward pass never reached "
                                   "the first transformer block")
    finally:
        handle.remove()
    return caught


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


# ---------------------------------------------------------------- the run


def calibrate(source: str | os.PathLike[str], out: str | os.PathLike[str], spec: CalibSpec,
              progress: Progress | None = None, warn: Warn | None = None) -> CalibResult:
    """Run SOURCE on calibration text block by block and write H per input group to OUT."""
    from transformers import AutoTokenizer

    from tq_cli.converter import resolve_device
    from tq_cli.io.source import resolve_source
    from tq_cli.plan import make_plan
    from tq_cli.recipe import resolve_recipe
    from tq_cli.spec import QuantSpec, RotationSpec
    from tq_cli.text import calibration_text, read_text

    t0 = time.perf_counter()
    warnings: list[str] = []

    def note(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    folder = resolve_source(source)
    src = open_source(folder)
    if src.config is None:
        raise SourceError(f"{folder}: no config.json; tq calibrate needs it to build the model")
    out_path = Path(out).expanduser()
    check_out(out_path, src)
    recipe = resolve_recipe(spec.recipe, src.config)
    # The same plan convert makes (rotation settings do not change which tensors convert).
    names = [t.info.name for t in make_plan(src, recipe, QuantSpec(),
                                            RotationSpec(kind="none")).converted]
    if not names:
        raise TqError(f"{folder}: no tensor matches a quantize rule of recipe '{recipe.name}'; "
                      "pass --recipe with one that fits this model")
    device = resolve_device(spec.device)
    text = calibration_text() if spec.text is None else read_text(spec.text)
    model = build_skeleton(folder, src.config)
    hf_config: Any = model.config
    cfg = hf_config.get_text_config()
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if isinstance(max_pos, int) and spec.seqlen > max_pos:
        raise UnsupportedError(f"--seqlen {spec.seqlen} is longer than the model's "
                               f"max_position_embeddings ({max_pos}); pass --seqlen {max_pos} "
                               "or less")
    seqs = token_sequences(AutoTokenizer.from_pretrained(folder), text, spec.samples,
                           spec.seqlen, note)
    prefix = getattr(model, "base_model_prefix", "") or ""
    modules = dict(model.named_modules())
    wanted = {c for n in names for c in _candidates(n.removesuffix(".weight"), prefix)}
    bpath, blocks = find_blocks(model, cfg.num_hidden_layers, wanted)
    layers = place_layers(model, names, recipe, prefix, bpath, len(blocks))
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
        "accumulation": "float64 sum of per-batch float32 x^T x",
        "source": {"fingerprint": src.fingerprint, "name": folder.name, "path": str(folder)},
        "text": {"source": text.source, "sha256": text.sha256},
        "samples": int(seqs.shape[0]), "samples_requested": spec.samples,
        "seqlen": spec.seqlen, "tokens": int(seqs.numel()), "batch_size": spec.batch_size,
        "device": str(device), "compute_dtype": "float32", "recipe": recipe.name,
        "tensors": {t: g.key for g in groups for t in g.members.values()},
        "groups": {g.key: list(g.members.values()) for g in groups},
        "uncalibrated": layers.uncalibrated,
    }
    with CalibrationWriter(out_path, {g.key: g.n for g in groups}, meta) as writer:
        def flush(g: _Group) -> None:
            g.check(recipe)
            h = g.h if g.h is not None else torch.zeros(g.n, g.n, dtype=torch.float64)
            writer.write(g.key, h, g.tokens)
            g.h = g.last = None
            if g.tokens == 0:
                note(f"{', '.join(g.members.values())}: saw no calibration tokens")

        _run(model, src, prefix, bpath, blocks, layers, modules, seqs, spec.batch_size, device,
             flush, progress)
    return CalibResult(out_path, folder, sum(len(g.members) for g in groups), len(groups),
                       int(seqs.shape[0]), spec.seqlen, int(seqs.numel()),
                       time.perf_counter() - t0, writer.size, str(device), text.source,
                       sorted(layers.uncalibrated), warnings)


@torch.no_grad()
def _run(model: nn.Module, src: SourceModel, prefix: str, bpath: str, blocks: nn.ModuleList,
         layers: _Layers, modules: dict[str, nn.Module], seqs: torch.Tensor, batch: int,
         device: torch.device, flush: Callable[[_Group], None],
         progress: Progress | None) -> None:
    """Catch block 0's inputs, then run, accumulate and release one block at a time."""
    weights = _Weights(src, prefix, device)
    # The base model's weights outside the blocks: embeddings, and the (small) final norm.
    base: nn.Module = getattr(model, "base_model", model)
    base_path = next(n for n, m in modules.items() if m is base)
    weights.load(base, base_path, skip=bpath)
    inputs = _catch(model, blocks[0], seqs, batch, device)
    weights.release(base, keep=layers.tail_norm)
    total = len(blocks) + (1 if layers.tail else 0)
    for i, block in enumerate(blocks):
        weights.load(block, f"{bpath}.{i}")
        handles = _hooks(layers.blocks[i], modules)
        try:
            for j, (args, kwargs) in enumerate(inputs):
                for g in layers.blocks[i]:
                    g.last = None  # a new batch: nothing is shared with the previous one
                y = block(*args, **kwargs)
                inputs[j] = _with_hidden(args, kwargs, y[0] if isinstance(y, tuple | list) else y)
        finally:
            for h in handles:
                h.remove()
        weights.release(block)
        for g in layers.blocks[i]:
            flush(g)
        if progress is not None:
            progress(i + 1, total)
    if layers.tail and layers.tail_norm is not None:
        for args, kwargs in inputs:
            normed = layers.tail_norm(_hidden(args, kwargs))
            for g in layers.tail:
                g.last = None
                for path in g.members:
                    g.add(path, normed)
        for g in layers.tail:
            flush(g)
        if progress is not None:
            progress(total, total)
    if layers.tail_norm is not None:
        weights.release(layers.tail_norm)

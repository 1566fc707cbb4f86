"""The behavioural self-check at the end of a conversion: does what was written run, in
the family's own code, near the original?

Before the checkpoint is moved into place, the model config.json describes is built on
the meta device (the calibration's skeleton, `tq_cli.calibration.collect.prepare_run`)
and run on a few random token ids: the first and the last transformer block are each
materialised from the source and run in the family's own forward, once with the original
weights and once with the converted layers as the loader builds them (TQLinear, a MoE's
TQExperts) from the partial folder's shards and manifest; then the head, if it was
converted. A crash, a non-finite output, or a block's change of the hidden state (its
output minus its input: the residual would hide any error) further than `FAR` from the
original's fails the conversion. The cost is two blocks and the embeddings read, and one
short sequence: seconds at any size, reported in `--json` as `self_check`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.errors import TqError, UnsupportedError

# A block's error, relative to the original's change of the hidden state, at which the
# converted block does no better than no block at all (an output change of zero is 1.0
# away): not a quantized copy of the original. 4-bit random weights give about 0.1-0.2,
# 2-bit ones about 0.4-0.6; a wrong layout, rotation or kernel about 1-1.4 (an unrelated
# output of the same size is sqrt(2) away).
FAR = 1.0
TOKENS = 16  # one sequence of this many random ids
# Where the blocks cannot run one at a time, sources up to this size are checked whole.
WHOLE_MODEL_BYTES = 1 << 30
# A block larger than this in float32 (a 671B MoE's, about 45 GB) is not checked: the
# check must not set a conversion's peak.
BLOCK_BYTES = 8 << 30


class SelfCheckError(TqError):
    """The converted checkpoint does not run, or runs far from its original."""


def self_check(planned: Any, partial: Path, device: torch.device,
               out: Path | None = None) -> dict[str, Any]:
    """Run the check on the finished `partial` folder; returns what `--json` reports
    (`ran`: False with `why` where the model's blocks cannot be run one at a time), or
    raises SelfCheckError naming the block and how far it is."""
    t0 = time.perf_counter()
    try:
        try:
            result = _check(planned, partial, device, t0, out or partial)
        except _Skip as e:
            why = str(e)
            if getattr(planned, "partial", False):
                # --allow-partial: what the loader will refuse is no verdict on the layers
                why += "; the source is partial (--allow-partial), so not the whole model"
            elif _small(planned):
                try:
                    return _whole(planned, partial, device, t0, out or partial, why)
                except _Skip as e2:
                    why = f"{why}; and the whole model: {e2}"
            return {"ran": False, "why": why, "seconds": round(time.perf_counter() - t0, 3)}
    except SelfCheckError:
        raise
    except Exception as e:  # the check itself broke, not the checkpoint: said, not fatal
        return {"ran": False, "why": f"the self-check could not run ({_why(e)})",
                "seconds": round(time.perf_counter() - t0, 3)}
    return result


def _small(planned: Any) -> bool:
    """Source and the model its config describes both small enough to load whole twice
    (a partial source's config may describe a far larger model than its tensors)."""
    if planned.model.total_bytes > WHOLE_MODEL_BYTES or planned.model.config is None:
        return False
    try:
        from tq_cli.runtime.hf_models import build_skeleton

        skeleton = build_skeleton(planned.folder, planned.model.config, real_buffers=False)
    except Exception:
        return False
    return sum(p.numel() for p in skeleton.parameters()) * 4 <= 2 * WHOLE_MODEL_BYTES


def _whole(planned: Any, partial: Path, device: torch.device, t0: float, label: Path,
           why: str) -> dict[str, Any]:
    """A small model whose blocks cannot run alone (an image-text encoder, Whisper's
    audio, T5's tied encoder embedding): the whole converted checkpoint, as `tq_cli.load`
    loads it, beside the original on one made-up input; the same measure, the output's
    error over the original output's norm."""
    from tq_cli.runtime.hf_models import load_plain
    from tq_cli.runtime.loader import load

    try:
        ref = load_plain(planned.folder, device)
        inputs = _made_up_inputs(ref)
        with torch.no_grad():
            y_ref = _output(ref(**inputs))
    except Exception as e:
        raise _Skip(_why(e)) from None
    del ref
    try:
        model = load(partial, device=device, verify_checksums=False, compile=False)
        with torch.no_grad():
            y = _output(model(**inputs))
    except Exception as e:
        raise SelfCheckError(f"{label}: self-check: the converted model fails in "
                             f"{type(e).__name__ if not isinstance(e, TqError) else 'tq'}"
                             f" ({_why(e)}); the checkpoint was not written") from None
    rel = _judge(label, "the output", y, y_ref, torch.zeros_like(y_ref))
    return {"ran": True, "whole_model": True, "because": why,
            "rel_errors": {"output": round(rel, 6)},
            "seconds": round(time.perf_counter() - t0, 3)}


def _made_up_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """A few tokens, and an image or audio features where the model reads them."""
    cfg: Any = model.config
    g = torch.Generator().manual_seed(0)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(getattr(text, "vocab_size", 2) or 2)
    dev = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, 8), generator=g)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_features":  # Whisper: log-mel frames the encoder expects
        out = {"input_features": torch.randn(1, cfg.num_mel_bins, 2 * cfg.max_source_positions,
                                             generator=g)}
    else:
        out = {"input_ids": ids}
    vision = getattr(cfg, "vision_config", None)
    if vision is not None and getattr(vision, "image_size", None):
        size = int(vision.image_size)
        out["pixel_values"] = torch.randn(1, getattr(vision, "num_channels", 3), size, size,
                                          generator=g)
    if getattr(cfg, "is_encoder_decoder", False):
        start = getattr(cfg, "decoder_start_token_id", None) or 0
        out["decoder_input_ids"] = torch.full((1, 4), int(start))
    return {k: v.to(dev) for k, v in out.items()}


def _output(out: Any) -> torch.Tensor:
    if hasattr(out, "image_embeds") and out.image_embeds is not None:
        return torch.cat([out.image_embeds.flatten(), out.text_embeds.flatten()])
    for field in ("logits", "last_hidden_state"):
        value = getattr(out, field, None)
        if value is not None:
            return value
    return _first(out)


class _Skip(Exception):
    """The original model cannot be run block by block here: no verdict either way."""


def _check(planned: Any, partial: Path, device: torch.device, t0: float,
           label: Path) -> dict[str, Any]:
    try:
        run = _run(planned, device)
    except Exception as e:  # what the calibration cannot run (an encoder-decoder, ...)
        raise _Skip(_why(e)) from None
    last = len(run.blocks) - 1
    for i in sorted({0, last}):
        size = sum(p.numel() for p in run.blocks[i].parameters()) * 4
        if size > BLOCK_BYTES:
            raise _Skip(f"block {i} holds {size / 1e9:.1f} GB in float32, more than the "
                        f"check's {BLOCK_BYTES / 1e9:.0f} GB")
    out = _Stored(partial, device, label)
    inputs = run.inputs[0]
    args, kwargs = inputs
    errors: dict[str, float] = {}
    hidden = None
    for i in sorted({0, last}):
        if hidden is not None:
            from tq_cli.calibration.skeleton import with_hidden

            args, kwargs = with_hidden(args, kwargs, hidden)
        hidden, errors[f"block {i}"] = _compare_block(run, i, args, kwargs, out)
    head = out.head_entry()
    if head is not None and hidden is not None:
        rel = _compare_head(run, head, hidden, out)
        if rel is not None:
            errors["head"] = rel
    return {"ran": True, "tokens": TOKENS, "rel_errors": {k: round(v, 6) for k, v in
                                                          errors.items()},
            "seconds": round(time.perf_counter() - t0, 3)}


def _run(planned: Any, device: torch.device) -> Any:
    from tq_cli.calibration.collect import CalibSpec, prepare_run
    from tq_cli.calibration.random_tokens import random_token_ids, special_ids
    from tq_cli.io.text import Text

    cfg = planned.model.config or {}
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab = text_cfg.get("vocab_size") if text_cfg else None
    if not isinstance(vocab, int) or vocab < 2:
        raise UnsupportedError("config.json names no vocab_size to draw token ids from")
    ids = torch.tensor(random_token_ids(vocab, special_ids(cfg), TOKENS, seed=0)).view(1, -1)
    drawn = Text(" ".join(map(str, ids.view(-1).tolist())), "self-check ids")
    return prepare_run(planned, CalibSpec(samples=1, seqlen=TOKENS, device=str(device)),
                       lambda _msg: None, ids=(ids, drawn))


def _rel(y: torch.Tensor, y_ref: torch.Tensor, x: torch.Tensor) -> float:
    """||y - y_ref|| over the original's change of the hidden state ||y_ref - x||."""
    change = float((y_ref - x).float().norm())
    floor = 1e-6 * float(y_ref.float().norm())
    return float((y - y_ref).float().norm()) / max(change, floor, 1e-30)


def _compare_block(run: Any, i: int, args: tuple, kwargs: dict,
                   out: _Stored) -> tuple[torch.Tensor, float]:
    from tq_cli.calibration.skeleton import BlockWeights, hidden_of

    block = run.blocks[i]
    path = f"{run.bpath}.{i}"
    weights = BlockWeights(run.source, run.prefix, run.device, run.sources)
    try:
        weights.load(block, path)
    except TqError as e:  # the original's weights do not fit its model: no verdict
        weights.release(block)
        raise _Skip(f"block {i} of the original cannot be read ({_why(e)})") from None
    try:
        x = hidden_of(args, kwargs)
        with torch.no_grad():
            try:
                y_ref = _first(block(*args, **kwargs))
            except Exception as e:
                raise _Skip(f"block {i} of the original does not run alone ({_why(e)})") \
                    from None
            swapped: list[tuple[str, nn.Module]] = []
            try:
                swapped = out.swap_in(run.model, run.modules, path)
                with _as_loaded(run.model):
                    y = _first(block(*args, **kwargs))
            except Exception as e:
                raise SelfCheckError(
                    f"{out.label}: self-check: block {i} of the converted model fails in "
                    f"{type(run.model).__name__}'s own forward ({_why(e)}); the checkpoint "
                    "would not run, so it was not written") from None
            finally:
                for name, old in swapped:
                    run.model.set_submodule(name, old)
    finally:
        weights.release(block)
    return y_ref, _judge(out.label, f"block {i}", y, y_ref, x)


def _compare_head(run: Any, entry: Any, hidden: torch.Tensor, out: _Stored) -> float | None:
    from tq_cli.calibration.skeleton import BlockWeights

    head = run.model.get_output_embeddings()
    name = next((n for n, m in run.modules.items() if m is head), None)
    if head is None or name is None:
        return None
    weights = BlockWeights(run.source, run.prefix, run.device, run.sources)
    try:
        weights.load(head, name)
    except TqError:  # a head the calibration's reader cannot place: not checked
        weights.release(head)
        return None
    try:
        with torch.no_grad():
            try:
                y_ref = head(hidden)
            except Exception:
                return None
            try:
                y = out.layer(entry, head)(hidden)
            except Exception as e:
                raise SelfCheckError(f"{out.label}: self-check: the converted head fails "
                                     f"({_why(e)}); the checkpoint was not written") from None
    finally:
        weights.release(head)
    return _judge(out.label, "the head", y, y_ref, torch.zeros_like(y_ref))


def _judge(label: Path, what: str, y: torch.Tensor, y_ref: torch.Tensor,
           x: torch.Tensor) -> float:
    if not bool(torch.isfinite(y_ref).all()):
        raise _Skip(f"the original's {what} is not finite on random ids")
    if not bool(torch.isfinite(y).all()):
        raise SelfCheckError(f"{label}: self-check: {what} of the converted model gives "
                             "non-finite values; the checkpoint was not written")
    rel = _rel(y, y_ref, x)
    if rel >= FAR:
        raise SelfCheckError(
            f"{label}: self-check: {what} of the converted model is {rel:.2f} of the "
            f"original's output change away from it (no better than leaving it out at "
            f"{FAR:g}); the checkpoint was not written: report this with the model's "
            "config.json")
    return rel


@contextlib.contextmanager
def _as_loaded(model: nn.Module) -> Iterator[None]:
    """The configs marked quantized, as transformers marks a model it loads with a
    quantizer: some families' code then calls a layer instead of reading its weight
    (Jamba's and Mamba's dt_proj)."""
    from transformers import PreTrainedModel

    configs = {id(m.config): m.config for m in model.modules()
               if isinstance(m, PreTrainedModel)}
    marked = [c for c in configs.values() if not hasattr(c, "_is_quantized")]
    for c in marked:
        c._is_quantized = True
    try:
        yield
    finally:
        for c in marked:
            del c._is_quantized


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}" if not isinstance(e, TqError) else first


def _first(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple | list) else y


class _Stored:
    """The partial folder's converted layers, built as the loader builds them."""

    def __init__(self, folder: Path, device: torch.device, label: Path) -> None:
        from tq_cli.io.format import converted_entries
        from tq_cli.io.manifest import read_manifest
        from tq_cli.io.safetensors_reader import open_source

        self.folder, self.device, self.label = folder, device, label
        self.manifest = read_manifest(folder)
        self.entries = converted_entries(self.manifest)
        self.shards = open_source(folder)
        self.rotations: dict[str, nn.Module] = {}

    def head_entry(self) -> Any:
        heads = {e["name"] for e in self.manifest["tensors"] if e.get("head")}
        return next((e for e in self.entries if e.name in heads), None)

    def _tensor(self, key: str) -> torch.Tensor:
        from tq_cli.io.safetensors_reader import read_tensor

        return read_tensor(self.shards.tensors[key]).to(self.device)

    def _rotation(self, rid: str | None) -> nn.Module | None:
        from tq_cli.runtime.tq_linear import RotationMaterial

        if rid is None:
            return None
        if rid not in self.rotations:
            info = self.manifest["rotations"][rid]
            tensors = {k.rsplit(".", 1)[1]: self._tensor(k) for k in info["keys"]}
            rot = RotationMaterial(info["kind"], info["block"],
                                   {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
            for n, t in tensors.items():
                rot._buffers[n] = t
            self.rotations[rid] = rot
        return self.rotations[rid]

    def layer(self, e: Any, old: nn.Module) -> nn.Module:
        """The TQLinear of entry `e`, its buffers read, its bias the original module's."""
        from tq_cli.runtime.tq_linear import TQLinear

        tensors = {suffix: self._tensor(key) for suffix, key in e.keys.items()}
        bias = getattr(old, "bias", None)
        layer = TQLinear(e.shape[1], e.shape[0], bits=e.spec.bits,
                         group_size=e.spec.group_size,
                         specs={n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                         bias=(tuple(bias.shape), bias.dtype) if bias is not None else None)
        for n, t in tensors.items():
            layer.weight._buffers[n] = t
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        layer.set_rotation(self._rotation(e.rotation_id))  # type: ignore[arg-type]
        return layer

    def swap_in(self, model: nn.Module, modules: dict[str, nn.Module],
                path: str) -> list[tuple[str, nn.Module]]:
        """Put the converted layers of block `path` into `model`; the (name, original
        module) pairs to put back."""
        from tq_cli.runtime.experts import TQExperts
        from tq_cli.runtime.hf_quantizer import _module_name

        prefix = getattr(model, "base_model_prefix", "") or ""
        swapped: list[tuple[str, nn.Module]] = []
        experts: dict[str, dict[tuple[int, str], tuple[str, Any]]] = {}
        for e in self.entries:
            if e.expert is not None:
                of = _module_name(modules, prefix, e.expert.of)
                if of is not None and of.startswith(path + "."):
                    sub = e.module.removeprefix(e.expert.of + ".")
                    experts.setdefault(of, {})[(e.expert.index, e.expert.role)] = (
                        sub, self.layer(e, nn.Identity()))
                continue
            name = _module_name(modules, prefix, e.module)
            if name is None or not name.startswith(path + "."):
                continue
            old = modules[name]
            swapped.append((name, old))
            model.set_submodule(name, self.layer(e, old))
        for of, layers in experts.items():
            swapped.append((of, modules[of]))
            model.set_submodule(of, TQExperts(modules[of], layers))
        return swapped

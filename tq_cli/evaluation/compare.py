"""Measure what quantization costs: a candidate against its reference, on the same text.

Causal LMs: perplexity of both on the same scored tokens, the mean KL divergence of the
candidate's next-token distribution from the reference's, and top-1 agreement, over
windows of `context` tokens (non-overlapping by default; `stride` for sliding windows).
Encoders: mean-pooled, normalised embeddings of the text's paragraphs; cosine to the
reference's (mean, min) and the Spearman correlation of the two pairwise-similarity
matrices. Image-text models (CLIP, SigLIP): image and text embedding cosines and zero-shot
agreement on photographs (evaluation/image_text.py), the labelled scikit-image set by
default or a folder of the user's. Only one window's logits of each model are alive at a
time. `run_compare` is the `tq eval` default mode (a CompareSpec); `evaluate` the
comparison itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_cli.errors import TqError, UnsupportedError
from tq_cli.evaluation.spec import CompareSpec, EvalSpec
from tq_cli.io.format import MANIFEST
from tq_cli.io.images import CAPTIONS, PhotoSet, labelled_photographs, read_folder
from tq_cli.io.manifest import read_manifest, write_json
from tq_cli.io.source import resolve_source
from tq_cli.io.text import Text, paragraphs

Progress = Callable[[int, int], None]
# Where the labelled photographs are: tq_cli.demo_model.photographs_folder, which the
# library may not import (design.md, the rules), so the caller passes it.
Photographs = Callable[[], Path]


@dataclass(frozen=True)
class Window:
    begin: int  # first input token
    end: int  # one past the last input token
    first_target: int  # first token index whose prediction is scored

    @property
    def scored(self) -> int:
        return self.end - self.first_target


def windows(n_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """Windows over n tokens; every target from 1 to n-1 is scored exactly once.

    Non-overlapping (stride None or = context): windows [k*c, (k+1)*c) score their own
    tokens 1.. (the first token of a window has no context inside it and is not scored).
    Sliding (stride s < c): windows start every s tokens and each scores only the
    targets the previous window did not reach, with up to c - s tokens of context.
    """
    if context < 2:
        raise TqError(f"--context must be at least 2, got {context}")
    step = context if stride is None else stride
    if step < 1 or step > context:
        raise TqError(f"--stride must be between 1 and --context ({context}), got {step}")
    out: list[Window] = []
    prev_end = 0
    begin = 0
    while begin < n_tokens - 1:
        end = min(begin + context, n_tokens)
        first = max(begin + 1, prev_end)
        if end > first:
            out.append(Window(begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
        begin += step
    return out


def is_tq_folder(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def load_model(source: str | Path, device: torch.device) -> tuple[nn.Module, Path]:
    """A tq folder through tq_cli.load, anything else through transformers, in eval mode."""
    folder = resolve_source(source)
    if is_tq_folder(folder):
        from tq_cli.runtime.loader import load

        return load(folder, device=device, dtype=torch.float32), folder
    from tq_cli.runtime.hf_models import load_plain

    return load_plain(folder, device), folder


def source_path(folder: Path, manifest: dict[str, Any]) -> Path:
    """The source model a tq checkpoint was converted from, as its manifest records it."""
    source = manifest.get("source")
    src = source.get("path") if isinstance(source, dict) else None
    if not isinstance(src, str):
        raise TqError(f"{folder / MANIFEST}: no source path recorded; the checkpoint is "
                      "damaged")
    return Path(src)


def tokenizer_folder(folder: Path, manifest: dict[str, Any] | None = None) -> Path:
    """The folder holding a model's tokenizer: its own, or for a tq checkpoint without
    one, its source's (from the manifest, read here unless given)."""
    if (folder / "tokenizer_config.json").exists() or not is_tq_folder(folder):
        return folder
    src = source_path(folder, manifest if manifest is not None else read_manifest(folder))
    if (src / "tokenizer_config.json").exists():
        return src
    raise TqError(f"{folder}: no tokenizer here or in its source {src}; copy the source's "
                  f"tokenizer files into {folder}")


def causal_metrics(ref: nn.Module, cand: nn.Module, ids: torch.Tensor, context: int,
                   stride: int | None, progress: Progress | None = None) -> dict[str, Any]:
    """Perplexities, mean KL(ref || cand) and top-1 agreement over the scored tokens."""
    wins = windows(ids.numel(), context, stride)
    nll_ref = nll_cand = kl = 0.0
    agree = scored = 0
    dev = next(ref.parameters()).device
    for i, w in enumerate(wins):
        inp = ids[w.begin:w.end].to(dev)[None]
        sel = slice(w.first_target - w.begin - 1, w.end - w.begin - 1)
        target = ids[w.first_target:w.end].to(dev)
        with torch.no_grad():
            lr = ref(inp).logits[0, sel].float().log_softmax(-1)
            lc = cand(inp).logits[0, sel].float().log_softmax(-1)
        nll_ref -= float(lr.gather(-1, target[:, None]).sum())
        nll_cand -= float(lc.gather(-1, target[:, None]).sum())
        kl += float((lr.exp() * (lr - lc)).sum())
        agree += int((lr.argmax(-1) == lc.argmax(-1)).sum())
        scored += w.scored
        del lr, lc
        if progress:
            progress(i + 1, len(wins))
    if scored == 0:
        raise TqError("the text is too short: no token could be scored; pass a longer --text")
    return {
        "reference_perplexity": math.exp(nll_ref / scored),
        "candidate_perplexity": math.exp(nll_cand / scored),
        "kl_mean": kl / scored,
        "top1_agreement": agree / scored,
        "scored_tokens": scored,
        "windows": len(wins),
    }


def _ranks(x: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(x.numel(), dtype=x.dtype)
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties broken by order)."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def embed(model: nn.Module, tokenizer: Any, sentences: list[str], max_length: int,
          batch: int = 32) -> torch.Tensor:
    """Mean-pooled, L2-normalised last hidden states, one row per sentence."""
    dev = next(model.parameters()).device
    out = []
    for i in range(0, len(sentences), batch):
        enc = tokenizer(sentences[i:i + batch], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt").to(dev)
        with torch.no_grad():
            h = model(**enc).last_hidden_state.float()
        m = enc["attention_mask"][..., None].float()
        out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).cpu())
    return torch.cat(out)


def encoder_metrics(ref: nn.Module, cand: nn.Module, tokenizer: Any, sentences: list[str],
                    max_length: int) -> dict[str, Any]:
    if len(sentences) < 2:
        raise TqError("the text has fewer than 2 paragraphs of 40+ characters; pass a longer "
                      "--text")
    a = embed(ref, tokenizer, sentences, max_length)
    b = embed(cand, tokenizer, sentences, max_length)
    cos = (a * b).sum(-1)
    iu = torch.triu_indices(len(sentences), len(sentences), offset=1)
    sim_a, sim_b = (a @ a.T)[iu[0], iu[1]], (b @ b.T)[iu[0], iu[1]]
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "similarity_spearman": spearman(sim_a, sim_b), "sentences": len(sentences)}


def reference_for(candidate: Path, reference: str | None,
                  manifest: dict[str, Any] | None = None) -> str:
    """--reference, or the source recorded in the candidate's manifest (read here unless
    given) when reachable."""
    if reference is not None:
        return reference
    if manifest is None:
        if not is_tq_folder(candidate):
            raise TqError(f"{candidate}: not a tq checkpoint, so --reference is needed")
        manifest = read_manifest(candidate)
    src = source_path(candidate, manifest)
    if not src.is_dir():
        raise TqError(f"{candidate}: its source model {src} is not reachable here; "
                      "pass --reference")
    return str(src)


def processor_folder(folders: list[Path]) -> Path | None:
    """The first of `folders` (or, for a tq checkpoint, its source) holding an image
    processor (preprocessor_config.json), or None."""
    for folder in folders:
        if (folder / "preprocessor_config.json").is_file():
            return folder
        if is_tq_folder(folder):
            src = source_path(folder, read_manifest(folder))
            if (src / "preprocessor_config.json").is_file():
                return src
    return None


def pixel_values(photos: PhotoSet, folders: list[Path], model: nn.Module
                 ) -> tuple[torch.Tensor, str]:
    """The photographs as the model's input, and how they were prepared: with the image
    processor of the first of `folders` that has one, else `clip_pixels` at the vision
    tower's image_size (CLIP's resize, centre crop, mean and std)."""
    from tq_cli.evaluation.image_text import clip_pixels

    images = [p.image for p in photos.photos]
    folder = processor_folder(folders)
    if folder is not None:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(folder)
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        return pixels.float(), f"{type(processor).__name__} of {folder}"
    vision = getattr(model.config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    if not isinstance(size, int):
        raise UnsupportedError(f"{folders[0]}: no preprocessor_config.json and no "
                               "vision_config.image_size; copy the model's "
                               "preprocessor_config.json into it")
    return clip_pixels(images, size), (f"no preprocessor_config.json: resized and "
                                       f"centre-cropped to {size}, CLIP mean/std")


def photo_set(images: str | Path | None, photographs: Photographs | None) -> PhotoSet:
    """A user's folder (unlabelled), else the labelled photographs."""
    if images is not None:
        return read_folder(images)
    if photographs is None:
        raise TqError("an image-text model is compared on photographs: pass a folder of "
                      "PNG/JPEG files (--images), or photographs="
                      "tq_cli.demo_model.photographs_folder")
    return labelled_photographs(photographs())


def compare_image_text(ref: nn.Module, cand: nn.Module, folders: list[Path],
                       tokenizer: Any, photos: PhotoSet, progress: Progress | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(metrics, settings, each photograph's zero-shot picks) of cand against ref on the
    photographs and CAPTIONS; `folders` are where an image processor is looked for."""
    from tq_cli.evaluation.image_text import caption_inputs, image_text_metrics

    pixels, how = pixel_values(photos, folders, ref)
    labels = [None if p.label is None else CAPTIONS.index(p.label) for p in photos.photos]
    metrics = image_text_metrics(ref, cand, pixels, caption_inputs(tokenizer, CAPTIONS, ref),
                                 caption_inputs(tokenizer, CAPTIONS, cand), labels, progress)
    ref_pick, cand_pick = metrics.pop("reference_choices"), metrics.pop("candidate_choices")
    picks = [{"photo": p.name, "label": p.label, "reference": CAPTIONS[r],
              "candidate": CAPTIONS[c]}
             for p, r, c in zip(photos.photos, ref_pick, cand_pick, strict=True)]
    settings = {"images": photos.source, "images_sha256": photos.sha256,
                "photographs": len(photos.photos), "captions": len(CAPTIONS),
                "preprocessing": how}
    return metrics, settings, picks


def evaluate(candidate: str | Path, reference: str | None, text: Text, spec: EvalSpec,
             progress: Progress | None = None,
             cache: dict[str, tuple[nn.Module, Path]] | None = None,
             images: str | Path | None = None,
             photographs: Photographs | None = None) -> dict[str, Any]:
    """Compare candidate with reference on text (image-text models: on photographs); a
    JSON-ready dict of metrics and settings.

    `cache` keeps the loaded reference between calls (a sweep evaluates many candidates
    against one reference). `images`: a folder of PNG/JPEG files for an image-text model;
    without it `photographs()` gives the folder of the labelled photographs
    (tq_cli.demo_model.photographs_folder, called only for an image-text model).
    """
    from tq_cli.device import resolve_device
    from tq_cli.evaluation.image_text import is_image_text
    from tq_cli.runtime.hf_models import is_causal, load_tokenizer

    device = resolve_device(spec.device)
    t0 = time.perf_counter()
    cand, cand_folder = load_model(candidate, device)
    manifest = read_manifest(cand_folder) if is_tq_folder(cand_folder) else None
    ref_src = reference_for(cand_folder, reference, manifest)
    if cache is not None and ref_src in cache:
        ref, ref_folder = cache[ref_src]
    else:
        ref, ref_folder = load_model(ref_src, device)
        if cache is not None:
            cache[ref_src] = (ref, ref_folder)
    tok_folder = cand_folder if (cand_folder / "tokenizer_config.json").exists() else ref_folder
    tokenizer = load_tokenizer(tok_folder)
    settings: dict[str, Any] = {
        "text_source": text.source, "text_sha256": text.sha256, "device": str(device),
        "dtype": "float32",
    }
    extra: dict[str, Any] = {}
    if is_image_text(ref) or is_image_text(cand):
        if not (is_image_text(ref) and is_image_text(cand)):
            raise UnsupportedError(f"{cand_folder} and {ref_folder}: only one of them is an "
                                   "image-text model; pass the reference it was converted from")
        if spec.stride is not None:
            raise UnsupportedError(
                f"{ref_folder}: --stride applies to causal LMs; an image-text model embeds "
                "photographs and captions; drop --stride")
        metrics, shown, extra["zero_shot"] = compare_image_text(
            ref, cand, [cand_folder, ref_folder], tokenizer, photo_set(images, photographs),
            progress)
        settings = {**shown, "device": str(device), "dtype": "float32"}
        kind = "image-text"
    elif images is not None:
        raise UnsupportedError(f"{ref_folder}: --images applies to image-text models (CLIP, "
                               "SigLIP), which this is not; drop --images")
    elif is_causal(ref):
        longest = getattr(ref.config, "max_position_embeddings", None)
        if isinstance(longest, int) and spec.context > longest:
            raise UnsupportedError(
                f"{ref_folder}: --context {spec.context} is longer than the model supports "
                f"(max_position_embeddings {longest}); pass --context {longest} or less")
        ids = tokenizer(text.text, return_tensors="pt").input_ids[0]
        if spec.max_tokens:
            ids = ids[: spec.max_tokens]
        settings.update({"context": spec.context, "stride": spec.stride or spec.context,
                         "max_tokens": spec.max_tokens, "text_tokens": int(ids.numel())})
        metrics = causal_metrics(ref, cand, ids, spec.context, spec.stride, progress)
        settings["scored_tokens"] = metrics["scored_tokens"]
        kind = "causal-lm"
    else:
        if spec.stride is not None:
            raise UnsupportedError(
                f"{ref_folder}: --stride applies to causal LMs; this encoder embeds whole "
                "paragraphs (of at most --context tokens); drop --stride")
        sentences = paragraphs(text.text, limit=spec.max_sentences)
        max_length = min(spec.context, getattr(tokenizer, "model_max_length", 512), 512)
        metrics = encoder_metrics(ref, cand, tokenizer, sentences, max_length)
        settings.update({"max_length": max_length, "sentences": metrics["sentences"]})
        kind = "encoder"
    result: dict[str, Any] = {"kind": kind, "candidate": str(cand_folder),
                              "reference": str(ref_folder), "settings": settings,
                              "metrics": metrics, "seconds": round(time.perf_counter() - t0, 2),
                              **extra}
    if manifest is not None:
        result["bits_per_weight"] = manifest["summary"]["bits_per_weight"]
        for key in ("model_bits_per_weight", "head_bits"):  # conversions since the head
            if key in manifest["summary"]:
                result[key] = manifest["summary"][key]
    return result


def write_card(candidate: Path, result: dict[str, Any]) -> None:
    """Record an eval result in a tq folder's manifest and model card."""
    from tq_cli.conversion.card import render_card

    manifest = read_manifest(candidate)
    evals = manifest.get("eval") or []
    evals.append({k: result[k] for k in ("kind", "reference", "settings", "metrics")})
    manifest["eval"] = evals
    write_json(candidate / MANIFEST, manifest)
    (candidate / "README.md").write_text(render_card(manifest))


def run_compare(candidate: str | Path, text: Text, spec: CompareSpec,
                progress: Progress | None = None,
                photographs: Photographs | None = None) -> dict[str, Any]:
    """`tq eval`'s default mode: `evaluate` candidate against spec.reference (an
    image-text model on spec.images, else on `photographs()`), then with spec.write_card
    record the result in the candidate's manifest and card."""
    if spec.write_card and not is_tq_folder(resolve_source(candidate)):
        raise TqError(f"{candidate}: not a tq checkpoint, so --write-card has no card to "
                      "write to; drop it")
    result = evaluate(candidate, spec.reference, text, spec, progress, images=spec.images,
                      photographs=photographs)
    if spec.write_card:
        write_card(Path(result["candidate"]), result)
    return result

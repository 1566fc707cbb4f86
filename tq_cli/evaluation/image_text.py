"""Image-text models (CLIP, SigLIP: `get_image_features` and `get_text_features`): what
quantization costs, on photographs and a fixed list of captions.

- image and text cosine: per photograph (per caption), the cosine of the candidate's
  embedding to the reference's; mean and min.
- zero-shot agreement: each model picks, for each photograph, the caption whose
  embedding is most similar to the photograph's (argmax of the cosine; SigLIP's and
  CLIP's logit scale and bias do not move an argmax); the fraction of photographs where
  the candidate picks what the reference picks.
- top-1 accuracy of each model against the photographs' true captions, when known.

Pure functions of models and tensors; loading the models, the photographs and the
processor is `compare.py`'s. Embeddings are compared in float64, and a cosine is
dot / sqrt(|a|^2 |b|^2), so identical embeddings give exactly 1.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

# CLIP's normalisation (OpenAI's, also transformers' CLIPImageProcessor defaults): the
# fallback for a model folder without a preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Progress = Callable[[int, int], None]


def is_image_text(model: nn.Module) -> bool:
    """Whether a transformers model embeds both images and texts (CLIPModel, SiglipModel)."""
    return callable(getattr(model, "get_image_features", None)) and \
        callable(getattr(model, "get_text_features", None))


def clip_pixels(images: Sequence[Any], size: int) -> torch.Tensor:
    """The fallback preprocessing of RGB PIL images: the shorter side resized to `size`
    (bicubic), the centre `size` x `size` crop, scaled to [0, 1] and normalised with
    CLIP's mean and std. (N, 3, size, size) float32."""
    from PIL import Image

    mean = torch.tensor(CLIP_MEAN)[:, None, None]
    std = torch.tensor(CLIP_STD)[:, None, None]
    out = []
    for im in images:
        w, h = im.size
        scale = size / min(w, h)
        rw, rh = max(size, int(w * scale)), max(size, int(h * scale))
        im = im.convert("RGB").resize((rw, rh), Image.Resampling.BICUBIC)
        left, top = (rw - size) // 2, (rh - size) // 2
        im = im.crop((left, top, left + size, top + size))
        x = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        x = x.view(size, size, 3).permute(2, 0, 1).float() / 255.0
        out.append((x - mean) / std)
    return torch.stack(out)


def _features(out: Any) -> torch.Tensor:
    """transformers 5 returns the projected embeddings as `pooler_output`; 4 a tensor."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def caption_inputs(tokenizer: Any, captions: Sequence[str], model: nn.Module
                   ) -> dict[str, torch.Tensor]:
    """The captions tokenized as the model was trained: SigLIP padded to its full length
    with no attention mask (it pools the last position), CLIP padded to the longest;
    both cut at the text tower's max_position_embeddings."""
    text_config = getattr(model.config, "text_config", model.config)
    longest = int(getattr(text_config, "max_position_embeddings", 77))
    longest = min(longest, int(getattr(tokenizer, "model_max_length", longest) or longest))
    siglip = str(getattr(model.config, "model_type", "")).startswith("siglip")
    enc = tokenizer(list(captions), padding="max_length" if siglip else True,
                    truncation=True, max_length=longest, return_tensors="pt")
    keep = ("input_ids",) if siglip else ("input_ids", "attention_mask")
    return {k: enc[k] for k in keep if k in enc}


def image_embeddings(model: nn.Module, pixels: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """The model's image embeddings, one row per image, float64 on the CPU."""
    dev = next(model.parameters()).device
    embed = cast(Any, model).get_image_features
    out = []
    for i in range(0, len(pixels), batch):
        with torch.no_grad():
            out.append(_features(embed(pixel_values=pixels[i:i + batch].to(dev)))
                       .double().cpu())
    return torch.cat(out)


def text_embeddings(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's text embeddings, one row per caption, float64 on the CPU."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = cast(Any, model).get_text_features(**{k: v.to(dev) for k, v in inputs.items()})
    return _features(out).double().cpu()


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of a to b in float64 (identical rows: exactly 1.0)."""
    a, b = a.double(), b.double()
    den = ((a * a).sum(-1) * (b * b).sum(-1)).sqrt()
    return ((a * b).sum(-1) / den.clamp_min(1e-300)).clamp(-1.0, 1.0)


def zero_shot_choices(images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """For each image embedding, the index of the most similar text embedding (cosine;
    a tie goes to the first caption)."""
    a = torch.nn.functional.normalize(images.double(), dim=-1)
    b = torch.nn.functional.normalize(texts.double(), dim=-1)
    return (a @ b.T).argmax(-1)


def agreement(ref_choices: torch.Tensor, cand_choices: torch.Tensor) -> float:
    """The fraction of images for which both models pick the same caption."""
    return float((ref_choices == cand_choices).double().mean())


def accuracy(choices: torch.Tensor, labels: Sequence[int | None]) -> float | None:
    """The fraction of labelled images whose pick is their label (None: no labels)."""
    pairs = [(int(c), t) for c, t in zip(choices, labels, strict=True) if t is not None]
    return sum(c == t for c, t in pairs) / len(pairs) if pairs else None


def embedding_metrics(ref_images: torch.Tensor, cand_images: torch.Tensor,
                      ref_texts: torch.Tensor, cand_texts: torch.Tensor,
                      labels: Sequence[int | None]) -> dict[str, Any]:
    """The metrics of two models' embeddings of the same images and captions; `labels`
    is each image's true caption index (None where unknown)."""
    img, txt = cosines(ref_images, cand_images), cosines(ref_texts, cand_texts)
    ref_pick = zero_shot_choices(ref_images, ref_texts)
    cand_pick = zero_shot_choices(cand_images, cand_texts)
    return {
        "image_cosine_mean": float(img.mean()), "image_cosine_min": float(img.min()),
        "text_cosine_mean": float(txt.mean()), "text_cosine_min": float(txt.min()),
        "zero_shot_agreement": agreement(ref_pick, cand_pick),
        "reference_top1_accuracy": accuracy(ref_pick, labels),
        "candidate_top1_accuracy": accuracy(cand_pick, labels),
        "photographs": len(ref_images), "captions": len(ref_texts),
        "reference_choices": ref_pick.tolist(), "candidate_choices": cand_pick.tolist(),
    }


def image_text_metrics(ref: nn.Module, cand: nn.Module, pixels: torch.Tensor,
                       ref_text: dict[str, torch.Tensor], cand_text: dict[str, torch.Tensor],
                       labels: Sequence[int | None],
                       progress: Progress | None = None) -> dict[str, Any]:
    """Both models on the same pixels and captions (each model's captions tokenized by
    `caption_inputs` for it), then `embedding_metrics`."""
    steps = [lambda: image_embeddings(ref, pixels), lambda: image_embeddings(cand, pixels),
             lambda: text_embeddings(ref, ref_text), lambda: text_embeddings(cand, cand_text)]
    done = []
    for i, step in enumerate(steps):
        done.append(step())
        if progress:
            progress(i + 1, len(steps))
    return embedding_metrics(done[0], done[1], done[2], done[3], labels)

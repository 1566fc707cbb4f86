"""tq eval on image-text models (CLIP, SigLIP): image and caption embedding cosines and
zero-shot agreement against the reference, on the real photographs of scikit-image's
wheel (fetched once into the cache) or a folder of the user's; the pure functions on
hand-made embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from families import FAMILIES
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import SourceError, UnsupportedError
from tq_cli.evaluation.compare import evaluate
from tq_cli.evaluation.image_text import (
    accuracy,
    agreement,
    clip_pixels,
    cosines,
    embedding_metrics,
    zero_shot_choices,
)
from tq_cli.evaluation.spec import EvalSpec
from tq_cli.io.images import CAPTIONS, LABELS, labelled_photographs, read_folder
from tq_cli.io.text import Text
from tq_cli.quant.spec import QuantSpec

runner = CliRunner()
SPEC = ConvertSpec(quant=QuantSpec(bits=4, group_size=32), device="cpu")
UNUSED = Text("image-text models read no text", "unused")
# Measured on the tiny random models at 4 bits (group 32), docs/results.md: image cosine
# min 0.992 (CLIP) and 0.985 (SigLIP), text cosine min 0.976 and 0.977.
COSINE_FLOOR = 0.95
METRICS = {"image_cosine_mean", "image_cosine_min", "text_cosine_mean", "text_cosine_min",
           "zero_shot_agreement", "reference_top1_accuracy", "candidate_top1_accuracy",
           "photographs", "captions"}


# ------------------------------------------------------------------ pure functions


def test_zero_shot_picks_the_most_similar_caption_by_cosine() -> None:
    texts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])
    # By cosine, not the dot product: [1, 0.2] is nearest [1, 0] though its dot product
    # with the long [3, 3] is larger; [0, -1] is nearest [1, 0] (0 against -0.71, -1).
    images = torch.tensor([[1.0, 0.2], [0.2, 1.0], [1.0, 1.1], [0.0, -1.0]])
    assert zero_shot_choices(images, texts).tolist() == [0, 1, 2, 0]
    assert (images @ texts.T).argmax(-1).tolist() != [0, 1, 2, 0]
    # A tie goes to the first caption.
    assert zero_shot_choices(torch.tensor([[1.0, 1.0]]), texts[:2]).tolist() == [0]


def test_agreement_and_accuracy() -> None:
    ref, cand = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])
    assert agreement(ref, cand) == 0.75
    assert agreement(ref, ref) == 1.0
    assert accuracy(ref, [0, 1, None, 0]) == pytest.approx(2 / 3)
    assert accuracy(ref, [None] * 4) is None


def test_identical_embeddings_give_exactly_one() -> None:
    torch.manual_seed(0)
    a = torch.randn(50, 48) * torch.rand(50, 1) * 100
    assert cosines(a, a).tolist() == [1.0] * 50
    assert cosines(a, -a).tolist() == [-1.0] * 50
    assert float(cosines(a, a + 0.1 * torch.randn_like(a)).max()) < 1.0


def test_embedding_metrics_on_hand_made_embeddings() -> None:
    texts = torch.eye(3)
    ref_img = torch.tensor([[1.0, 0.1, 0.0], [0.0, 1.0, 0.2], [0.1, 0.0, 1.0]])
    cand_img = ref_img.clone()
    cand_img[2] = torch.tensor([0.0, 1.0, 0.9])  # now nearer caption 1
    m = embedding_metrics(ref_img, cand_img, texts, texts, [0, 1, 1])
    assert m["text_cosine_mean"] == m["text_cosine_min"] == 1.0
    assert m["image_cosine_min"] == pytest.approx(float(torch.cosine_similarity(
        ref_img[2], cand_img[2], dim=0)))
    assert m["zero_shot_agreement"] == pytest.approx(2 / 3)
    assert m["reference_choices"] == [0, 1, 2] and m["candidate_choices"] == [0, 1, 1]
    assert m["reference_top1_accuracy"] == pytest.approx(2 / 3)
    assert m["candidate_top1_accuracy"] == 1.0
    assert (m["photographs"], m["captions"]) == (3, 3)


def test_the_fallback_preprocessing_is_clips() -> None:
    from PIL import Image

    grey = Image.new("RGB", (60, 30), (128, 128, 128))
    x = clip_pixels([grey], 16)
    assert x.shape == (1, 3, 16, 16) and x.dtype == torch.float32
    mean, std = torch.tensor([0.48145466, 0.4578275, 0.40821073]), \
        torch.tensor([0.26862954, 0.26130258, 0.27577711])
    assert torch.allclose(x[0, :, 5, 5], (128 / 255 - mean) / std, atol=1e-6)


def test_a_folder_of_images_is_read_unlabelled(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("L", (20, 10), 40).save(tmp_path / "b_grey.png")
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "a_clear.png")
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "c.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    photos = read_folder(tmp_path)
    assert [p.name for p in photos.photos] == ["a_clear", "b_grey", "c"]
    assert all(p.image.mode == "RGB" and p.label is None for p in photos.photos)
    assert photos.photos[0].image.getpixel((0, 0)) == (255, 255, 255)  # laid on white
    assert not photos.labelled and len(photos.sha256) == 64
    with pytest.raises(SourceError, match="no PNG or JPEG file"):
        read_folder(_empty(tmp_path))
    with pytest.raises(SourceError, match="no image named astronaut"):
        labelled_photographs(tmp_path)


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir(exist_ok=True)
    return tmp_path / "empty"


def test_extracting_from_a_wheel_keeps_what_is_asked_and_refuses_escapes(
        tmp_path: Path) -> None:
    import zipfile

    from tq_cli.demo_model import extract_tree

    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("skimage/data/cat.png", "skimage/data/a.py", "skimage/data/sub/x.png",
                     "skimage/other.png"):
            z.writestr(name, b"x")
    out = tmp_path / "out"
    keep = lambda rel: len(rel.parts) == 1 and rel.suffix == ".png"  # noqa: E731
    assert extract_tree(wheel, "skimage/data/", out, keep) == 1
    assert [p.name for p in out.iterdir()] == ["cat.png"]
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("skimage/data/../../evil.png", b"x")
    with pytest.raises(SourceError, match="unsafe path"):
        extract_tree(wheel, "skimage/data/", tmp_path / "out2")
    assert not (tmp_path / "evil.png").exists()


def test_the_captions_are_distinct_and_every_label_is_one() -> None:
    assert len(set(CAPTIONS)) == len(CAPTIONS)
    assert {c for _, c in LABELS} == set(CAPTIONS)
    assert "a photo of a cat" in CAPTIONS and ("chelsea", "a photo of a cat") in LABELS


# -------------------------------------------------------- the tiny CLIP and SigLIP


def save_tokenizer(folder: Path) -> None:
    """A tiny byte-level BPE tokenizer (ids below the tiny models' 256) that ends every
    text with [EOS] (id 1), as CLIP's tokenizer does: CLIP pools the first EOS
    position, and without one every caption would pool position 0, the same "a"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["[PAD]", "[EOS]", "[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["a photo of the quick brown fox"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A [EOS]",
                                                       special_tokens=[("[EOS]", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(folder)


def build(name: str, folder: Path) -> Path:
    """tests/families.py's tiny model, its text tower told the tokenizer's EOS and PAD."""
    torch.manual_seed(0)
    model, _ = FAMILIES[name]()
    model.config.text_config.eos_token_id = 1
    model.config.text_config.pad_token_id = 0
    model.save_pretrained(folder, max_shard_size="200KB")
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module", params=["clip", "siglip"])
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    src = build(request.param, root / "src")
    convert(src, root / "tq4", SPEC)
    return request.param, src, root / "tq4"


@pytest.fixture(scope="session")
def photographs() -> Path:
    from tq_cli.demo_model import photographs_folder

    return photographs_folder()


def _user_folder(tmp_path: Path) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for i in range(3):
        pixels = torch.randint(0, 256, (40, 50, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(tmp_path / f"noise{i}.png")
    return tmp_path


def test_a_users_folder_is_compared_without_labels(pair: Any, tmp_path: Path) -> None:
    _, src, tq4 = pair
    r = evaluate(tq4, str(src), UNUSED, EvalSpec(device="cpu"), images=_user_folder(tmp_path))
    m = r["metrics"]
    assert r["kind"] == "image-text" and set(m) == METRICS
    assert m["photographs"] == 3 and m["captions"] == len(CAPTIONS)
    assert m["reference_top1_accuracy"] is None and m["candidate_top1_accuracy"] is None
    assert [z["photo"] for z in r["zero_shot"]] == ["noise0", "noise1", "noise2"]
    assert r["settings"]["images"] == str(tmp_path)
    assert "CLIP mean/std" in r["settings"]["preprocessing"]
    assert "text_source" not in r["settings"]


def test_images_with_a_model_that_is_not_image_text(tiny_bert: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="--images applies to image-text models"):
        evaluate(tiny_bert, str(tiny_bert), UNUSED, EvalSpec(device="cpu"),
                 images=_user_folder(tmp_path))


def test_images_is_refused_before_a_model_loads(tmp_path: Path) -> None:
    empty = _empty(tmp_path)
    r = runner.invoke(app, ["eval", str(tmp_path / "no-model"), "--images", str(empty)])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"usage error: --images: {empty} holds no PNG or JPEG file; pass a folder of images"]
    r = runner.invoke(app, ["eval", "x", "--images", str(tmp_path / "none")])
    assert r.exit_code == 2 and f"--images: {tmp_path / 'none'} is not a folder" in r.output
    r = runner.invoke(app, ["eval", "x", "--kv-bits", "4", "--images", str(tmp_path)])
    assert r.exit_code == 2 and "--images does not apply with --kv-bits (KV caches are " \
        "measured on text, not images); drop it" in r.output
    r = runner.invoke(app, ["eval", "x", "--sweep", "bits=4", "--images", str(tmp_path)])
    assert r.exit_code == 2 and "--images does not apply with --sweep (it compares on text, " \
        "not images); drop it" in r.output


@pytest.mark.realmodel
def test_the_labelled_photographs_are_real(photographs: Path) -> None:
    photos = labelled_photographs(photographs)
    assert len(photos.photos) == len(LABELS) and photos.labelled
    by_name = {p.name: p for p in photos.photos}
    assert by_name["chelsea"].label == "a photo of a cat"
    assert by_name["astronaut"].image.size == (512, 512)
    assert by_name["camera"].image.mode == "RGB"  # grey, expanded


@pytest.mark.realmodel
def test_candidate_against_itself_is_exact(pair: Any, photographs: Path) -> None:
    from tq_cli.demo_model import photographs_folder

    _, _, tq4 = pair
    r = evaluate(tq4, str(tq4), UNUSED, EvalSpec(device="cpu"),
                 photographs=photographs_folder)
    m = r["metrics"]
    assert m["image_cosine_mean"] == m["image_cosine_min"] == 1.0
    assert m["text_cosine_mean"] == m["text_cosine_min"] == 1.0
    assert m["zero_shot_agreement"] == 1.0
    assert m["reference_top1_accuracy"] == m["candidate_top1_accuracy"]
    assert m["photographs"] == len(LABELS)


@pytest.mark.realmodel
def test_the_converted_model_against_its_source(pair: Any, photographs: Path) -> None:
    name, src, tq4 = pair
    r = runner.invoke(app, ["eval", str(tq4), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    m = result["metrics"]
    assert result["kind"] == "image-text" and set(m) == METRICS
    assert result["reference"] == str(src) and 4 < result["bits_per_weight"] < 5
    for k in ("image_cosine_min", "text_cosine_min"):
        assert COSINE_FLOOR < m[k] < 1.0, (name, k, m[k])
    assert m["image_cosine_min"] <= m["image_cosine_mean"] < 1.0
    assert 0.0 <= m["zero_shot_agreement"] <= 1.0
    assert 0.0 <= m["reference_top1_accuracy"] <= 1.0  # random weights: about chance
    assert (m["photographs"], m["captions"]) == (len(LABELS), len(CAPTIONS))
    assert result["settings"]["images"].startswith("scikit-image photographs")
    assert [z["photo"] for z in result["zero_shot"]] == [n for n, _ in LABELS]
    agree = sum(z["reference"] == z["candidate"] for z in result["zero_shot"])
    assert agree / len(LABELS) == m["zero_shot_agreement"]
    # The table shows the same numbers.
    r = runner.invoke(app, ["eval", str(tq4), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "zero-shot agreement" in r.stdout and f"{m['zero_shot_agreement']:.4f}" in r.stdout


@pytest.mark.realmodel
def test_the_folders_image_processor_is_used(pair: Any, photographs: Path,
                                             tmp_path: Path) -> None:
    from transformers import AutoImageProcessor, AutoModel, CLIPImageProcessor

    from tq_cli.evaluation.compare import pixel_values

    _, src, _ = pair
    folder = tmp_path / "with-processor"
    folder.mkdir()
    CLIPImageProcessor(size={"shortest_edge": 32},
                       crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    photos = labelled_photographs(photographs)
    model = AutoModel.from_pretrained(src)
    ours, how = pixel_values(photos, [folder], model)
    assert "ImageProcessor" in how and str(folder) in how
    fallback, how = pixel_values(photos, [src], model)
    assert how.startswith("no preprocessor_config.json")
    # The fallback is CLIP's processor: the same with its PIL backend, close with
    # torchvision's.
    if type(AutoImageProcessor.from_pretrained(folder)).__name__.endswith("Pil"):
        assert torch.equal(ours, fallback)
    else:
        assert float((ours - fallback).abs().mean()) < 0.05

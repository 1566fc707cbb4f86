"""Photographs for comparing image-text models (CLIP, SigLIP): a labelled set, or any
folder of PNG/JPEG files.

The labelled set is the real photographs that ship inside scikit-image's wheel
(``skimage/data``), extracted once into tq's cache by
`tq_cli.demo_model.photographs_folder` (io imports only quant, so the caller passes the
folder here). `LABELS` names the ones whose content is plain from the picture, each with
the caption that describes it; `CAPTIONS`, their distinct captions in order, is the
fixed list a zero-shot classifier chooses from. `read_folder` reads a user's folder, with
no labels. Files are decoded with Pillow into RGB (grey expanded, transparency laid on
white).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tq_cli.errors import CorruptFileError, SourceError, UnsupportedError

SUFFIXES = (".png", ".jpg", ".jpeg")

# (file stem in skimage/data, the caption of what it shows).
LABELS: tuple[tuple[str, str], ...] = (
    ("astronaut", "a photo of an astronaut"),
    ("brick", "a photo of a brick wall"),
    ("camera", "a photo of a man with a camera"),
    ("chelsea", "a photo of a cat"),
    ("coffee", "a photo of a cup of coffee"),
    ("coins", "a photo of coins"),
    ("grass", "a photo of grass"),
    ("gravel", "a photo of gravel"),
    ("horse", "a silhouette of a horse"),
    ("hubble_deep_field", "a photo of galaxies in space"),
    ("ihc", "a microscope photo of stained tissue"),
    ("moon", "a photo of the surface of the moon"),
    ("motorcycle_left", "a photo of a motorcycle"),
    ("motorcycle_right", "a photo of a motorcycle"),
    ("page", "a photo of a page of text"),
    ("retina", "a photo of a retina"),
    ("rocket", "a photo of a rocket"),
    ("text", "a photo of handwritten equations"),
)
CAPTIONS: tuple[str, ...] = tuple(dict.fromkeys(caption for _, caption in LABELS))


@dataclass(frozen=True)
class Photo:
    name: str  # the file's stem
    image: Any  # a PIL.Image.Image in RGB
    label: str | None  # its caption, when known


@dataclass(frozen=True)
class PhotoSet:
    """Photographs read from one folder, in order, with the sha256 of their bytes."""

    source: str
    photos: tuple[Photo, ...]
    sha256: str

    @property
    def labelled(self) -> bool:
        return all(p.label is not None for p in self.photos)


def image_files(folder: Path) -> list[Path]:
    """The PNG and JPEG files directly in `folder`, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)


def decode(path: Path) -> Any:
    """One image file as an RGB PIL image; a file Pillow cannot read is one line."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise UnsupportedError("reading images needs Pillow, which is not installed: pip "
                               "install 'tq[models]'") from None
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and
                                                   "transparency" in im.info):
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, rgba).convert("RGB")
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CorruptFileError(f"{path}: not a readable image ({first})") from None


def _photo_set(source: str, files: list[Path], labels: list[str | None]) -> PhotoSet:
    digest = hashlib.sha256()
    photos = []
    for path, label in zip(files, labels, strict=True):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
        photos.append(Photo(path.stem, decode(path), label))
    return PhotoSet(source, tuple(photos), digest.hexdigest())


def read_folder(folder: str | Path) -> PhotoSet:
    """Every PNG/JPEG file directly in `folder`, unlabelled."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"{folder}: not a folder of images")
    files = image_files(folder)
    if not files:
        raise SourceError(f"{folder}: no PNG or JPEG file in it")
    return _photo_set(str(folder), files, [None] * len(files))


def labelled_photographs(folder: Path) -> PhotoSet:
    """The photographs `LABELS` names, from the folder scikit-image's images were
    extracted into, each with its caption."""
    by_stem = {p.stem: p for p in image_files(folder)}
    missing = [name for name, _ in LABELS if name not in by_stem]
    if missing:
        raise SourceError(f"{folder}: no image named {', '.join(missing)}; delete the "
                          "folder and it will be extracted again")
    return _photo_set(f"scikit-image photographs ({folder})",
                      [by_stem[name] for name, _ in LABELS], [c for _, c in LABELS])

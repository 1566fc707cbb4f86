"""Text for calibration and evaluation: embedded by default, any UTF-8 file otherwise.

The default is Python's own documentation, `pydoc_data.topics.topics` (about 80 long
English documents that every Python install has). Its keys are sorted and split in
two: the first half is calibration text, the second half evaluation text, so a model is
never scored on a document it was calibrated on. Its contents follow the Python version,
which is recorded with the text's sha256 wherever a number depends on it.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

from tq_cli.errors import SourceError


@dataclass(frozen=True)
class Text:
    text: str
    source: str  # where it came from, for the record

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _topics(part: str) -> Text:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    keys = sorted(topics)
    half = len(keys) // 2
    chosen = keys[:half] if part == "calibration" else keys[half:]
    return Text("\n\n".join(topics[k] for k in chosen),
                f"pydoc_data.topics {part} split ({len(chosen)} of {len(keys)} sorted keys, "
                f"{chosen[0]}..{chosen[-1]}; Python {platform.python_version()})")


def calibration_text() -> Text:
    return _topics("calibration")


def evaluation_text() -> Text:
    return _topics("evaluation")


def read_text(path: str | Path | None) -> Text:
    """The evaluation text: a UTF-8 file, or the embedded default when path is None."""
    if path is None:
        return evaluation_text()
    p = Path(path)
    try:
        return Text(p.read_text(encoding="utf-8"), str(p))
    except FileNotFoundError as e:
        raise SourceError(f"{p}: no such text file; pass a UTF-8 file to --text") from e
    except UnicodeDecodeError as e:
        raise SourceError(f"{p}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from e
    except OSError as e:
        raise SourceError(f"{p}: cannot read ({e.strerror})") from e


def paragraphs(text: str, min_chars: int = 40, limit: int = 256) -> list[str]:
    """Sentence-sized pieces for encoder evaluation: non-trivial paragraphs, in order."""
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        if len(para) >= min_chars:
            out.append(para)
            if len(out) == limit:
                break
    return out

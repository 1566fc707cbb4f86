"""The library's exceptions. Only the CLI turns them into a message and an exit code."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class TqError(Exception):
    """A user-facing error: the message names the file, the tensor and the fix."""


class SourceError(TqError):
    """The source model cannot be read or found."""


class CorruptFileError(SourceError):
    """A safetensors file or index is damaged or lies about its contents."""


class UnsupportedError(TqError):
    """The input is valid but tq cannot do what was asked with it."""


class RecipeError(TqError):
    """A recipe file is invalid."""


class OutputError(TqError):
    """The output folder cannot be written as asked."""


class SeedSearchError(TqError):
    """A seed search cannot run as asked, or its log or SEEDS file is unusable."""


class NonFiniteError(TqError):
    """A tensor holds NaN or Inf values."""


def first_error(e: ValidationError) -> tuple[str, str]:
    """(where, what) of a pydantic error's first problem, for one-line messages:
    ("tensors.3.shape", "Input should be a valid list")."""
    err = e.errors()[0]
    return (".".join(str(x) for x in err["loc"]),
            str(err["msg"]).removeprefix("Value error, "))

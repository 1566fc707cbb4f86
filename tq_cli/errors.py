"""The library's exceptions. Only the CLI turns them into a message and an exit code."""

from __future__ import annotations


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

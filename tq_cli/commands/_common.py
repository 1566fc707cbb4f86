"""Helpers shared by the subcommands: error reporting, JSON output, progress on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tq_cli.errors import TqError

stderr = Console(stderr=True)
stdout = Console()
T = TypeVar("T")


def fail(message: str) -> typer.Exit:
    """Print a one-line error on stderr and return the exit to raise (code 1)."""
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


def run_library(fn: Callable[[], T]) -> T:
    """Call into the library, turning its errors into one line and exit code 1."""
    try:
        return fn()
    except TqError as e:
        raise fail(str(e)) from None
    except OSError as e:  # disk full, permissions: name the file, no traceback
        where = e.filename or "tq"
        raise fail(f"{where}: {e.strerror or e}; free space or fix permissions, then rerun "
                   "(convert: with --resume)") from None
    except KeyboardInterrupt:
        stderr.print("interrupted")
        raise typer.Exit(code=130) from None


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def tensor_progress(enabled: bool = True) -> Iterator[Progress]:
    """A Rich progress bar on stderr (bytes done, tensors in the description)."""
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(),
        DownloadColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=stderr, transient=False, disable=not enabled,
    )
    with progress:
        yield progress

"""Helpers shared by the subcommands: error reporting, JSON output, progress on stderr."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tq_cli.conversion.flags import BY_FLAG, QUANT_OPTIONS, nest, usage_message
from tq_cli.errors import TqError

stderr = Console(stderr=True)
stdout = Console()


def fail(message: str) -> typer.Exit:
    """Print a one-line error on stderr and return the exit to raise (code 1)."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


def one_line(e: BaseException) -> tuple[str, int]:
    """Any exception as (one line for stderr, exit code), for the CLI's error boundary
    (tq_cli.app.Boundary).

    tq's own errors are the user's to fix (1); an OSError names its file (1); Ctrl-C is
    130; anything else is a bug in tq, still one line, with how to get the traceback.
    """
    if isinstance(e, TqError):
        return " ".join(str(e).split("\n")), 1
    if isinstance(e, OSError):  # disk full, permissions: name the file, no traceback
        where = e.filename or "tq"
        return (f"{where}: {e.strerror or e}; free space or fix permissions, then rerun "
                "(convert: with --resume)"), 1
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(e, MemoryError):
        return ("out of memory; use a smaller --context, --batch-size or model, or a "
                "machine with more memory"), 1
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return (f"internal error: {type(e).__name__}: {first} (a bug in tq; rerun with "
            "TQ_DEBUG=1 for the traceback and report it)"), 1


def quant_option(flag: str) -> Any:
    """The typer option for one of the shared quantization flags (tq_cli.conversion.flags)."""
    o = BY_FLAG[flag]
    default = None if flag == "temperature" else o.default  # parsed from text below
    return typer.Option(default, f"--{flag}", help=o.help)


def quant_values(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The shared quantization flags a command took (its locals()), nested by spec."""
    values = {}
    for o in QUANT_OPTIONS:
        name = o.flag.replace("-", "_")
        if name in params:
            value = params[name]
            values[o.field] = o.parse(value) if isinstance(value, str) else value
    return nest(values)


def usage(message: str) -> typer.Exit:
    """Print one usage-error line on stderr and return the exit to raise (code 2)."""
    stderr.print(f"[bold red]usage error:[/] {escape(message)}", highlight=False,
                 soft_wrap=True)
    return typer.Exit(code=2)


def usage_error(e: ValidationError, flags: dict[str, str] | None = None) -> typer.Exit:
    """A spec's validation error as one usage line naming the flag (exit code 2);
    `flags`: spec locations whose flag is not --<field-name> (tq_cli.conversion.flags)."""
    return usage(usage_message(e, flags))


def warning(console: Console, message: str) -> None:
    """One warning line (on the progress bar's console while a bar is drawn)."""
    console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def progress_bar(unit: Literal["bytes", "count"] = "count",
                 enabled: bool = True) -> Iterator[Progress]:
    """The one Rich progress bar of every command, on stderr: bytes (convert) or a count
    (blocks, windows, tensors) done, elapsed and remaining time. It stays on screen after
    success and is cleared after an error, so a failure prints exactly one line."""
    done = DownloadColumn() if unit == "bytes" else TextColumn("{task.completed}/{task.total}")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), done,
                        TimeElapsedColumn(), TimeRemainingColumn(), console=stderr,
                        transient=False, disable=not enabled)
    with progress:
        try:
            yield progress
        except BaseException as e:
            if not (isinstance(e, typer.Exit) and e.exit_code == 0):
                progress.live.transient = True
            raise


def tensor_progress(enabled: bool = True) -> contextlib.AbstractContextManager[Progress]:
    """convert's bar: bytes of the source done, tensors counted in the description."""
    return progress_bar("bytes", enabled)


# The mmap threshold while GPTQ runs: its temporaries (a few MB: a block's columns, the
# scale refit's systems) come from the heap, whole tensors are still mapped and returned.
GPTQ_HEAP_THRESHOLD = 32 << 20


def bound_heap_growth(threshold: int = 1 << 20) -> None:
    """Return freed tensor memory to the OS promptly (glibc only).

    glibc raises its mmap threshold after large frees, so later tensors of a few MB land
    in the heap and fragment it; a long data-free conversion's RSS then creeps upward
    with the number of tensors. A fixed 1 MiB threshold keeps its peak memory flat.
    `tq calibrate` and `tq eval --sweep` set it (calibrate's peak on SmolLM2 is 698 MB
    with it, 1,182 MB without, for 5 s of page faults), and so does `tq convert`,
    except with `--calib`: GPTQ allocates and frees large temporaries all the time, and
    a fresh mmap for each cost SmolLM2 50 s of page faults (83 s wall against 54 s, for
    a peak of 457 MB against 735 MB). `--synthetic-calib` keeps it, since its
    calibration forward is what sets the peak (751 MB and 174 s with it, 1,748 MB and
    119 s without). Self-calibration, now the default, keeps it for its forward and then
    raises it to `GPTQ_HEAP_THRESHOLD` for GPTQ (docs/decisions.md has the numbers).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, threshold)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass

"""`tq calibrate`: options -> CalibSpec -> `calibrate`, with progress and a table."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import ValidationError
from rich.progress import (
    TaskID,
)
from rich.table import Table

from tq_cli.commands._common import (
    bound_heap_growth,
    emit_json,
    progress_bar,
    stdout,
    usage_error,
    warning,
)

HELP = "Run a model on calibration text and save each converted layer's input statistics."
EPILOG = """Examples:

  tq calibrate ./SmolLM2-135M -o smol.calib

  tq calibrate ./SmolLM2-135M -o smol.calib --text corpus.txt --samples 256 --seqlen 1024

  tq convert ./SmolLM2-135M -o smol-tq3 --bits 3 --calib smol.calib

  torchrun --nproc-per-node 2 -m tq_cli calibrate ./SmolLM2-135M -o smol.calib

The model runs one transformer block at a time, so memory is one block plus the
calibration activations; under torchrun each rank runs a share of the sequences. Without
--text the embedded calibration split of Python's pydoc topics is used (never the half tq
eval scores on).
"""
FLAGS = {"samples": "--samples", "seqlen": "--seqlen", "device": "--device",
         "batch_size": "--batch-size", "recipe": "--recipe", "text": "--text"}


def main(
    source: str = typer.Argument(..., help="Model folder, or a Hugging Face hub id (org/name)."),
    out: Path = typer.Option(..., "-o", "--out", help="Calibration file to write (safetensors)."),
    text: Path | None = typer.Option(None, "--text", help="UTF-8 text file (default: the "
                                                           "embedded pydoc calibration split)."),
    samples: int = typer.Option(128, "--samples", help="Sequences of --seqlen tokens."),
    seqlen: int = typer.Option(512, "--seqlen", help="Tokens per sequence."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward call."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    recipe: str | None = typer.Option(None, "--recipe",
                                      help="Recipe name (llama, bert, generic) or TOML path."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
) -> None:
    from tq_cli.calibration.collect import CalibSpec, calibrate

    try:
        spec = CalibSpec(text=str(text) if text is not None else None, samples=samples,
                         seqlen=seqlen, device=device,
                         recipe=recipe, batch_size=batch_size)
    except ValidationError as e:
        raise usage_error(e, FLAGS) from None

    from tq_cli.parallel import finish_comm, torchrun_comm

    comm = torchrun_comm()  # under torchrun: the ranks share the sequences; rank 0 writes
    rank0 = comm is None or comm.rank == 0
    with progress_bar(enabled=rank0) as bar:
        tasks: list[TaskID] = []  # added at the first block, so an early error prints alone

        def on_block(done: int, total: int) -> None:
            if not tasks:
                tasks.append(bar.add_task("blocks", total=total))
            bar.update(tasks[0], completed=done, total=total)

        def warn(msg: str) -> None:
            if rank0:
                warning(bar.console, msg)

        bound_heap_growth()  # 698 MB peak on SmolLM2 instead of 1,182, for 5 s of faults
        try:
            result = calibrate(source, out, spec, progress=on_block, warn=warn, comm=comm)
        finally:
            finish_comm(comm)
    if not rank0:
        return
    summary = result.summary()
    if as_json:
        emit_json(summary)
        return
    table = Table(title=f"tq calibrate -> {result.out}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in [("layers calibrated", str(result.calibrated)),
                 ("input groups (matrices)", str(result.groups)),
                 ("sequences x tokens", f"{result.samples} x {result.seqlen}"),
                 ("tokens", str(result.tokens)),
                 ("not calibrated", str(len(result.uncalibrated))),
                 ("file size", f"{result.file_bytes / 1e6:.1f} MB"),
                 ("time", f"{result.seconds:.1f} s"), ("device", result.device)]:
        table.add_row(k, v)
    stdout.print(table)

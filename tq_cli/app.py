"""The `tq` command line: a Typer app whose subcommands live in tq_cli.commands.

Exit codes: 0 success, 1 a user error (one line on stderr), 2 a usage error, 3 a bench
regression, 130 interrupted. `main` is the one error boundary: nothing reaches the user
as a traceback unless TQ_DEBUG=1.
"""

from __future__ import annotations

import os
import sys

import typer

from tq_cli.commands import bench as bench_cmd
from tq_cli.commands import calibrate as calibrate_cmd
from tq_cli.commands import convert as convert_cmd
from tq_cli.commands import eval as eval_cmd
from tq_cli.commands import search_seed as search_seed_cmd
from tq_cli.commands._common import one_line, stderr
from tq_cli.version import __version__

app = typer.Typer(
    name="tq",
    help="Convert language models into low-bit TurboQuant checkpoints and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(name="convert", help=convert_cmd.HELP, epilog=convert_cmd.EPILOG)(convert_cmd.main)
app.command(name="eval", help=eval_cmd.HELP, epilog=eval_cmd.EPILOG)(eval_cmd.main)
app.command(name="calibrate", help=calibrate_cmd.HELP,
            epilog=calibrate_cmd.EPILOG)(calibrate_cmd.main)
app.command(name="search-seed", help=search_seed_cmd.HELP,
            epilog=search_seed_cmd.EPILOG)(search_seed_cmd.main)
app.command(name="bench", help=bench_cmd.HELP, epilog=bench_cmd.EPILOG)(bench_cmd.main)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """tq: TurboQuant conversion toolchain."""


def main() -> None:
    try:
        app()
    except Exception as e:  # whatever a command let through: still one line
        if os.environ.get("TQ_DEBUG"):
            raise
        message, code = one_line(e)
        stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
        sys.exit(code)

"""The `tq` command line: a Typer app whose subcommands live in tq_cli.commands.

Exit codes: 0 success, 1 a user error (one line on stderr), 2 a usage error, 3 a bench
regression, 130 interrupted. `Boundary` is the one error boundary: whatever a command
lets through becomes one line and its exit code; nothing reaches the user as a traceback
unless TQ_DEBUG=1.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from tq_cli.commands import bench as bench_cmd
from tq_cli.commands import calibrate as calibrate_cmd
from tq_cli.commands import convert as convert_cmd
from tq_cli.commands import eval as eval_cmd
from tq_cli.commands import search_seed as search_seed_cmd
from tq_cli.commands._common import one_line, stderr
from tq_cli.errors import TqError
from tq_cli.version import __version__

# Exits a command chose and usage errors, which typer and click report themselves: typer
# from 0.2x has exceptions of its own (and a click of its own), older ones use click's.
_PASS_THROUGH: tuple[type[BaseException], ...] = (
    typer.Exit, typer.Abort, *[c for c in (getattr(typer, "TyperException", None),)
                               if isinstance(c, type)])
with contextlib.suppress(ImportError):
    import click

    _PASS_THROUGH += (click.exceptions.Exit, click.ClickException, click.Abort)


class Boundary(TyperGroup):
    """The app's command group, whose `invoke` turns any exception from a command into one
    line on stderr and an exit code (tq_cli.commands._common.one_line). Inside click's
    own handling, so `tq`, `python -m tq_cli` and CliRunner behave the same; it sees
    Ctrl-C (130) before click turns it into "Aborted!"."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _PASS_THROUGH:
            raise  # an exit a command chose, usage errors: typer and click report them
        except BaseException as e:
            if isinstance(e, SystemExit | GeneratorExit):
                raise
            if os.environ.get("TQ_DEBUG") and not isinstance(e, TqError | OSError |
                                                             KeyboardInterrupt):
                raise
            message, code = one_line(e)
            label = "[bold red]error:[/] " if code == 1 else ""
            stderr.print(f"{label}{escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None


app = typer.Typer(
    cls=Boundary,
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
    app()

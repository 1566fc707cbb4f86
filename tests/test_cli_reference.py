"""docs/cli.md is the `--help` of every command as the CLI prints it now
(scripts/cli_reference.py renders it; run that script after changing a command's help)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    return load_script("cli_reference")


def test_cli_reference_is_current() -> None:
    ref = _script()
    page = ref.render()
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == page, (
        "docs/cli.md is out of date: run python scripts/cli_reference.py")


def test_cli_reference_covers_every_command() -> None:
    ref = _script()
    page = ref.render()
    for command in ref._commands():
        assert f"## `tq {command}`" in page
        assert f"Usage: tq {command} [OPTIONS]" in page
    assert "\x1b[" not in page
    assert max(len(line) for line in page.splitlines()) <= ref.WIDTH

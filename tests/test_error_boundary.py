"""The CLI's one error boundary (tq_cli.app.Boundary): whatever a command lets through is
one line on stderr with an exit code that means something, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.errors import SourceError

runner = CliRunner()


def _raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr("tq_cli.commands.convert.convert", boom)


def _convert(tmp_path: Path) -> object:
    return runner.invoke(app, ["convert", str(tmp_path), "-o", str(tmp_path / "o")])


@pytest.mark.parametrize(("exc", "code", "line"), [
    (SourceError("a.safetensors: truncated; re-download it"), 1,
     "error: a.safetensors: truncated; re-download it"),
    (OSError(28, "No space left on device", "out/x"), 1,
     "error: out/x: No space left on device; free space or fix permissions, then rerun "
     "(convert: with --resume)"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (MemoryError(), 1, "error: out of memory; use a smaller --context, --batch-size or "
                       "model, or a machine with more memory"),
    (ValueError("bad\nsecond line"), 1, "error: internal error: ValueError: bad (a bug in "
                                        "tq; rerun with TQ_DEBUG=1 for the traceback and "
                                        "report it)"),
])
def test_every_exception_is_one_line_and_an_exit_code(
        exc: BaseException, code: int, line: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQ_DEBUG", raising=False)
    _raising(monkeypatch, exc)
    r = _convert(tmp_path)
    assert r.exit_code == code  # type: ignore[attr-defined]
    assert r.stderr.strip() == line  # type: ignore[attr-defined]
    assert "Traceback" not in r.output  # type: ignore[attr-defined]


def test_brackets_in_a_message_are_printed_not_read_as_markup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _raising(monkeypatch, SourceError("needs transformers: pip install 'tq[models]'"))
    r = _convert(tmp_path)
    assert r.stderr.strip() == (  # type: ignore[attr-defined]
        "error: needs transformers: pip install 'tq[models]'")


def test_tq_debug_shows_the_traceback_of_a_bug(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_DEBUG", "1")
    _raising(monkeypatch, ValueError("bad"))
    r = _convert(tmp_path)
    assert isinstance(r.exception, ValueError)  # type: ignore[attr-defined]

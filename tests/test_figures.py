"""The figures in docs/ are what their committed numbers draw."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = sorted((ROOT / "docs" / "figures").glob("*.json"))


@pytest.mark.parametrize("points", FIGURES, ids=[p.stem for p in FIGURES])
def test_each_figure_matches_its_numbers(points: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_quality.py"), str(points),
                        str(points.with_suffix(".svg")), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_there_is_a_figure() -> None:
    assert FIGURES

"""The CLI: exit codes, --json, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tq_cli.app import app

runner = CliRunner()


def test_convert_json_summary(small_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(small_folder), "--allow-partial",
                            "-o", str(out), "--bits", "3",
                            "--group-size", "32", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["tensors_converted"] == 1 and data["tensors_kept"] == 1
    assert {"bits_per_weight", "mean_rel_error", "seconds", "throughput_mb_s",
            "source_bytes", "output_bytes"} <= set(data)
    assert 3.0 < data["bits_per_weight"] < 4.0


def test_table_output(small_folder: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(small_folder), "--allow-partial",
                            "-o", str(tmp_path / "o")])
    assert r.exit_code == 0
    assert "bits per weight (converted)" in r.stdout


def test_user_error_is_one_line_exit_1(tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "o")])
    assert r.exit_code == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no such folder" in lines[0]


def test_usage_errors_exit_2(small_folder: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(small_folder), "-o", str(tmp_path / "o"),
                            "--bits", "5"])
    assert r.exit_code == 2 and "quantization options: bits must be 2, 3, 4 or 8, got 5" in r.stderr
    r = runner.invoke(app, ["convert", str(small_folder)])
    assert r.exit_code == 2
    r = runner.invoke(app, ["convert", str(small_folder), "-o", str(tmp_path / "o"),
                            "--rotation", "spiral"])
    assert r.exit_code == 2 and "--rotation: Input should be 'hadamard'" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_request_without_cuda(small_folder: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(small_folder), "--allow-partial",
                            "-o", str(tmp_path / "o"),
                            "--device", "cuda"])
    assert r.exit_code == 1 and "no CUDA device is available" in r.stderr


def test_help_has_examples() -> None:
    r = runner.invoke(app, ["convert", "--help"])
    assert r.exit_code == 0 and "tq convert ./SmolLM2-135M -o ./smol-tq4" in r.stdout

"""tq bench: the gate names what regressed, quick mode runs whole, quality is deterministic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tq_cli.app import app
from tq_cli.bench import quality
from tq_cli.bench.metrics import BaselineError, Metric, compare
from tq_kernels import cpu as cpu_kernel

runner = CliRunner()
QUALITY_KEY = "quality.heavy.tq.hadamard.3bit.rel_error"


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    r = runner.invoke(app, ["bench", "--quick", "--device", "cpu", "--json", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def _baseline(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(data))
    return path


def test_quick_run_has_every_section(quick_result: dict[str, Any]) -> None:
    assert quick_result["mode"] == "quick"
    assert set(quick_result["sections"]) == {"quality", "kernels", "conversion"}
    assert quick_result["seconds"] < 120  # the bound for --quick on 2 cores
    m = quick_result["metrics"]
    assert m[QUALITY_KEY]["kind"] == "quality"
    assert m["kernels.cpu.smollm2.4bit.geomean_matmul_over_torch"]["kind"] == "speed"
    assert m["convert.cpu.quick.4bit.peak_rss_mb"]["kind"] == "memory"
    env = quick_result["environment"]
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert {"triton", "cuda", "cpu_count", "device_name"} <= set(env)
    if cpu_kernel.available():
        assert env["cpu_gemm"] == cpu_kernel.gemm_precision()
        assert env["cpu_isa"] == cpu_kernel.active_isa()
    conv = quick_result["sections"]["conversion"][0]
    assert conv["convert_over_copy"] == pytest.approx(
        (conv["convert_s"] - conv["check_s"]) / conv["copy_s"])
    assert 0 < conv["check_s"] < conv["convert_s"]
    assert 4.0 < conv["bits_per_weight"] < 4.3
    backend = quick_result["sections"]["kernels"][0]["backend"]
    assert backend.startswith(("cpu-", "torch reference")), backend


def test_matching_baseline_passes_exactly(quick_result: dict[str, Any], tmp_path: Path) -> None:
    # Quality is deterministic up to float summation order: the native CPU fit and the
    # torch fit differ by up to 8e-6 relative on the heavy-tailed matrix (measured), and a
    # run where one of them could not be used (a kernel cache being rebuilt) mixes them, so
    # the tolerance is 1e-4 relative (0.01%), a hundred times below the CI gate's 1%.
    base = _baseline(tmp_path, quick_result)
    r = runner.invoke(app, ["bench", "--section", "quality", "--device", "cpu",
                            "--baseline", str(base), "--max-regression", "1e-4"])
    assert r.exit_code == 0, r.output
    assert "no regression" in r.stderr


def test_better_baseline_fails_and_names_the_metric(quick_result: dict[str, Any],
                                                    tmp_path: Path) -> None:
    data = json.loads(json.dumps(quick_result))
    data["metrics"][QUALITY_KEY]["value"] *= 0.9  # a baseline 10% better than today
    base = _baseline(tmp_path, data)
    r = runner.invoke(app, ["bench", "--section", "quality", "--device", "cpu",
                            "--baseline", str(base)])
    assert r.exit_code == 3
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("regression:")]
    assert len(lines) == 1 and lines[0].startswith(f"regression: {QUALITY_KEY}: ")
    assert "+11.1% worse, limit 1.0%" in lines[0]


def test_missing_baseline_is_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "--quick", "--baseline", str(tmp_path / "none.json")])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"error: {tmp_path / 'none.json'}: no such baseline; write one "
                                f"with tq bench --json {tmp_path / 'none.json'}")


def test_compare_rules() -> None:
    base = {"environment": {"device_type": "cuda"}, "metrics": {
        "q": {"value": 1.0, "kind": "quality"}, "s": {"value": 1.0, "kind": "speed"},
        "i": {"value": 1.0, "kind": "info"}, "gone": {"value": 1.0, "kind": "quality"}}}
    cur = {"q": Metric(1.005, "quality"), "s": Metric(9.0, "speed"), "i": Metric(50.0, "info")}
    c = compare(cur, "cpu", base, max_regression=0.01, max_slowdown=0.5)
    # Speed against a baseline from another device kind is skipped, info is never gated.
    assert c.compared == 1 and not c.regressions
    assert sorted(s.split(":")[0] for s in c.skipped) == ["gone", "s"]
    c = compare(cur, "cuda", base, max_regression=0.001, max_slowdown=0.5)
    assert [r.name for r in c.regressions] == ["q", "s"]
    higher = {"environment": {"device_type": "cpu"},
              "metrics": {"h": {"value": 10.0, "kind": "speed"}}}
    c = compare({"h": Metric(4.0, "speed", better="higher")}, "cpu", higher, 0.0, 0.5)
    assert c.regressions[0].change == pytest.approx(0.6)
    with pytest.raises(BaselineError, match="shares no metric"):
        compare({"x": Metric(1.0, "quality")}, "cpu", base, 0.01, 0.5)


def test_kernel_timings_compare_only_like_gemm_products() -> None:
    base = {"environment": {"device_type": "cpu", "cpu_gemm": "bf16"}, "metrics": {
        "kernels.cpu.x": {"value": 1.0, "kind": "speed"},
        "convert.cpu.y": {"value": 1.0, "kind": "speed"}}}
    cur = {"kernels.cpu.x": Metric(9.0, "speed"), "convert.cpu.y": Metric(1.0, "speed")}
    c = compare(cur, "cpu", base, 0.01, 0.5, current_cpu_gemm="fp32")
    assert c.compared == 1 and not c.regressions
    assert c.skipped == ["kernels.cpu.x: baseline ran bf16 CPU GEMM products, this run fp32"]
    for gemm in ("bf16", None):  # the same products, or a run that did not record them
        c = compare(cur, "cpu", base, 0.01, 0.5, current_cpu_gemm=gemm)
        assert [r.name for r in c.regressions] == ["kernels.cpu.x"]


def test_cpu_speeds_compare_only_like_instruction_sets() -> None:
    base = {"environment": {"device_type": "cpu", "cpu_isa": "avx512"}, "metrics": {
        "kernels.cpu.x": {"value": 1.0, "kind": "speed"},
        "convert.cpu.y": {"value": 1.0, "kind": "speed"},
        "convert.cpu.m": {"value": 1.0, "kind": "memory"},
        "q": {"value": 1.0, "kind": "quality"}}}
    cur = {"kernels.cpu.x": Metric(9.0, "speed"), "convert.cpu.y": Metric(9.0, "speed"),
           "convert.cpu.m": Metric(1.0, "memory"), "q": Metric(1.0, "quality")}
    c = compare(cur, "cpu", base, 0.01, 0.5, current_cpu_isa="avx2")
    assert c.compared == 2 and not c.regressions
    assert c.skipped == ["convert.cpu.y: baseline ran tq's avx512 CPU kernels, this run avx2",
                         "kernels.cpu.x: baseline ran tq's avx512 CPU kernels, this run avx2"]
    for isa in ("avx512", None):  # the same instruction set, or a run that did not record it
        c = compare(cur, "cpu", base, 0.01, 0.5, current_cpu_isa=isa)
        assert [r.name for r in c.regressions] == ["convert.cpu.y", "kernels.cpu.x"]


def test_quality_matrices_are_fixed_and_heavy_tailed() -> None:
    a, b = quality.matrix("heavy"), quality.matrix("heavy")
    assert torch.equal(a, b)
    g = quality.matrix("gaussian")
    kurt = lambda x: float(((x - x.mean()) ** 4).mean() / x.var() ** 2)  # noqa: E731
    assert kurt(g) == pytest.approx(3.0, abs=0.1)
    col_rms = a.pow(2).mean(0).sqrt()
    assert int((col_rms > 5 * col_rms.median()).sum()) == quality.OUTLIER_COLUMNS

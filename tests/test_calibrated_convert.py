"""convert --calib and --target-bits on a tiny Llama: calibrate, convert, load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from weighted import weighted_errors

from tq_cli.app import app
from tq_cli.calibration.collect import CalibSpec, calibrate
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.io.calibration import Calibration, read_calibration
from tq_cli.io.manifest import read_manifest
from tq_cli.quant.spec import QuantSpec

runner = CliRunner()
QUANT = QuantSpec(bits=3, group_size=32)


@pytest.fixture(scope="module")
def calib_file(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calib") / "tiny.calib"
    calibrate(tiny_llama, out, CalibSpec(samples=8, seqlen=64, device="cpu"))
    return out


def test_calibrated_convert_beats_data_free(tiny_llama: Path, calib_file: Path,
                                            tmp_path: Path) -> None:
    free, cal = tmp_path / "free", tmp_path / "cal"
    convert(tiny_llama, free, ConvertSpec(quant=QUANT, device="cpu"))
    r = convert(tiny_llama, cal, ConvertSpec(quant=QUANT, calib=str(calib_file), device="cpu"))
    assert r.calibrated_tensors == r.tensors_converted - 1 == 14  # all but the 8-bit head
    m = read_manifest(cal)
    assert m["calibration"]["file"] == "tiny.calib" and m["calibration"]["damp"] == 0.01
    assert m["calibration"]["sha256"] == read_calibration(calib_file).sha256
    calib = read_calibration(calib_file)
    e_free, e_cal = weighted_errors(free, calib), weighted_errors(cal, calib)
    for t in m["tensors"]:
        if t["action"] == "quantize" and t["name"] != "lm_head.weight":
            assert t["calibrated"] is True
            # the manifest's figure comes from the fit's float32 products (rotated basis),
            # this one from float64 ones in the original basis
            assert t["weighted_rel_error"] == pytest.approx(e_cal[t["name"]], rel=1e-4)
    better = sum(e_cal[n] < e_free[n] for n in e_cal)
    assert better == len(e_cal), {n: (e_free[n], e_cal[n]) for n in e_cal}
    total_free, total_cal = sum(e_free.values()), sum(e_cal.values())
    assert total_cal < 0.8 * total_free
    # Same format: the loader runs it like any other checkpoint.
    from tq_cli.runtime.loader import load

    model = load(cal, device="cpu", dtype=torch.float32)
    logits = model(torch.arange(10)[None]).logits
    assert torch.isfinite(logits).all()


def test_calibration_for_another_model_refused(tiny_bert: Path, calib_file: Path,
                                               tmp_path: Path) -> None:
    with pytest.raises(TqError) as e:
        convert(tiny_bert, tmp_path / "o", ConvertSpec(calib=str(calib_file)))
    assert str(e.value).startswith(f"{calib_file}: made for model 'tiny-llama' (")
    assert str(e.value).endswith(f"run tq calibrate on {tiny_bert}")
    assert not (tmp_path / "o").exists()


def test_unusable_layer_falls_back_with_a_warning(tiny_llama: Path, calib_file: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = Calibration.hessian
    broken = "model.layers.0.mlp.down_proj.weight"
    empty = "model.layers.1.self_attn.o_proj.weight"

    def patched(self: Calibration, name: str) -> torch.Tensor | None:
        if name == empty:
            return None  # as an expert that saw no tokens
        h = real(self, name)
        if name == broken and h is not None:
            h[0, 0] = float("nan")
        return h

    monkeypatch.setattr(Calibration, "hessian", patched)
    logs: list[str] = []
    r = convert(tiny_llama, tmp_path / "o", ConvertSpec(quant=QUANT, calib=str(calib_file),
                                                        device="cpu"), log=logs.append)
    assert r.calibrated_tensors == r.tensors_converted - 3  # and the head: weight-only
    assert f"tensor '{empty}': saw no calibration tokens; quantized data-free" in logs
    assert any(m.startswith(f"tensor '{broken}': ") and "non-finite" in m for m in logs)
    by_name = {t["name"]: t for t in read_manifest(tmp_path / "o")["tensors"]}
    assert by_name[empty]["calibrated"] is False and by_name[empty]["fallback"]


def test_target_bits_mixed_precision(tiny_llama: Path, calib_file: Path,
                                     tmp_path: Path) -> None:
    out = tmp_path / "mixed"
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(out), "--group-size", "32",
                            "--calib", str(calib_file), "--target-bits", "3.5", "--device",
                            "cpu", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    mixed = summary["mixed_precision"]
    assert mixed["target_bits"] == 3.5 and mixed["error"] == "fisher-weighted"
    assert summary["bits_per_weight"] <= 3.5
    assert summary["bits_per_weight"] == pytest.approx(mixed["achieved_bits"], abs=1e-5)
    m = read_manifest(out)
    # the head keeps its 8 bits outside the allocation (and the summary's figure)
    assert [t["spec"]["bits"] for t in m["tensors"] if t["name"] == "lm_head.weight"] == [8]
    widths = {t["spec"]["bits"] for t in m["tensors"]
              if t["action"] == "quantize" and t["name"] != "lm_head.weight"}
    assert len(widths) >= 2  # a real mix, not one width for all
    # group 32 costs 0.5 bits per weight in scales: 3 and 4 bits alone cannot reach 3.5,
    # so the default widths keep 2 bits
    assert m["mixed_precision"]["choices"] == [2, 3, 4]
    assert m["mixed_precision"]["tensors_per_bits"] == {
        str(b): sum(1 for t in m["tensors"] if t.get("spec", {}).get("bits") == b)
        for b in (2, 3, 4)}
    from tq_cli.runtime.loader import load

    model = load(out, device="cpu", dtype=torch.float32)
    assert torch.isfinite(model(torch.arange(10)[None]).logits).all()


def test_default_widths_leave_2_bits_out_from_3_5_where_3_and_4_reach(
        tiny_llama: Path, tmp_path: Path) -> None:
    from tq_cli.conversion.mixed_precision import default_bit_choices
    from tq_cli.planning.prepare import plan_source
    from tq_cli.quant.spec import QuantSpec

    g128 = plan_source(tiny_llama, None, QuantSpec(group_size=128)).plan
    g32 = plan_source(tiny_llama, None, QuantSpec(group_size=32)).plan
    assert default_bit_choices(g128, 3.5) == (3, 4)
    assert default_bit_choices(g128, 4.25) == (3, 4)
    assert default_bit_choices(g128, 3.49) == (2, 3, 4)
    assert default_bit_choices(g32, 3.5) == (2, 3, 4)  # 3 bits at group 32 is over 3.5
    assert default_bit_choices(g32, 3.7) == (3, 4)
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                            "--target-bits", "3.6", "--fast", "--json"])
    assert r.exit_code == 0, r.output
    mixed = json.loads(r.stdout)["mixed_precision"]
    assert mixed["choices"] == [3, 4] and set(mixed["tensors_per_bits"]) == {"3", "4"}
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "p"),
                            "--target-bits", "3.6", "--bit-choices", "2,3,4", "--fast",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["mixed_precision"]["choices"] == [2, 3, 4]


def test_target_below_reach_is_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["convert", str(tiny_llama), "-o", str(tmp_path / "o"),
                            "--group-size", "32", "--target-bits", "2.01",
                            "--bit-choices", "3,4"])
    assert r.exit_code == 1
    assert "below the smallest achievable" in r.stderr
    assert not (tmp_path / "o").exists()


def test_search_seed_calib_objective_reproduced_by_convert(tiny_llama: Path, calib_file: Path,
                                                           tmp_path: Path) -> None:
    from tq_cli.seedsearch.grid import SearchSpec, search

    seeds = tmp_path / "seeds.json"
    doc = search(tiny_llama, seeds, SearchSpec(seeds=[0, 1, 2], objective="calib",
                                               calib=str(calib_file), quant=QUANT,
                                               finalists=2, device="cpu"))
    assert doc is not None and doc["calib_sha256"] == read_calibration(calib_file).sha256
    out = tmp_path / "o"
    convert(tiny_llama, out, ConvertSpec(quant=QUANT, calib=str(calib_file),
                                         seeds_file=str(seeds), device="cpu"))
    by_name = {t["name"]: t for t in read_manifest(out)["tensors"]}
    for name, t in doc["tensors"].items():
        assert by_name[name]["rotation"]["seed"] == t["seed"]
        assert by_name[name]["weighted_rel_error"] == t["score"]  # the same GPTQ run

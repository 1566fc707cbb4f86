"""The default conversion's self-calibration streamed block by block: no calibration file,
one block's Hessians at a time, the same tensors as from a file, and --resume at the block
it was in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tinymodels import build_tiny_llama

from tq_cli.calibration import skeleton
from tq_cli.calibration.random_tokens import synthetic_calibration
from tq_cli.calibration.stream import StreamedCalibration
from tq_cli.conversion.converter import ConvertSpec, convert, partial_path
from tq_cli.conversion.ranks import STATES_DIR
from tq_cli.io.manifest import read_manifest
from tq_cli.planning.prepare import plan_source
from tq_cli.quant.spec import QuantSpec

QUANT = QuantSpec(bits=3, group_size=32)
TOKENS = 512
SPEC = ConvertSpec(quant=QUANT, device="cpu", synthetic_calib=TOKENS)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-4", layers=4)


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


def _block_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loads: list[str] = []
    real = skeleton.BlockWeights.load

    def counting(self: skeleton.BlockWeights, module: object, path: str,
                 skip: str = "\0") -> None:
        loads.append(path)
        real(self, module, path, skip)  # type: ignore[arg-type]

    monkeypatch.setattr(skeleton.BlockWeights, "load", counting)
    return loads


def test_streamed_tensors_equal_those_from_a_calibration_file(llama4: Path,
                                                              tmp_path: Path) -> None:
    streamed = tmp_path / "streamed"
    convert(llama4, streamed, SPEC)
    planned = plan_source(llama4, None, QUANT, SPEC.rotation)
    folder = tmp_path / "calib"
    folder.mkdir()
    path, record = synthetic_calibration(planned, TOKENS, SPEC.rotation.seed, folder, "cpu")
    from_file = tmp_path / "file"
    convert(llama4, from_file, ConvertSpec(quant=QUANT, device="cpu", calib=str(path)))
    assert _shards(streamed) == _shards(from_file)
    assert read_manifest(streamed)["calibration"]["text_sha256"] == record["text_sha256"]
    assert not list(tmp_path.glob("tq-synth-*")) and not (streamed / STATES_DIR).exists()


def test_one_block_of_hessians_at_a_time_and_each_block_runs_once(
        llama4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads = _block_loads(monkeypatch)
    alive: list[set[int]] = []
    real = StreamedCalibration.hessian

    def watching(self: StreamedCalibration, name: str) -> object:
        h = real(self, name)
        stage = self.run.block_of()
        alive.append({stage[k] for k in self._ready})
        return h

    monkeypatch.setattr(StreamedCalibration, "hessian", watching)
    convert(llama4, tmp_path / "o", SPEC)
    blocks = [p for p in loads if ".layers." in p]
    assert blocks == [f"model.layers.{i}" for i in range(4)]
    assert alive and max(len(s) for s in alive) <= 1
    # every block's tensors asked in block order: each stage's Hessians, then the next's
    stages = [min(s) for s in alive if s]
    assert stages == sorted(stages) and set(stages) == {0, 1, 2, 3}


def test_resume_starts_at_the_block_it_was_in(llama4: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"

    class Stop(Exception):
        pass

    def stop_in_block_2(fin: object, _n: int) -> None:
        name = fin.plan.info.name  # type: ignore[attr-defined]
        if ".layers.2." in name and "_proj" in name:
            raise Stop

    with pytest.raises(Stop):
        convert(llama4, out, SPEC, progress=stop_in_block_2)
    partial = partial_path(out)
    kept = sorted(p.name for p in (partial / STATES_DIR).iterdir())
    assert kept == ["rank0.block00001.safetensors", "rank0.block00002.safetensors"]
    loads = _block_loads(monkeypatch)
    r = convert(llama4, out, SPEC.model_copy(update={"resume": True}))
    assert r.resumed_tensors > 0
    # blocks 0 and 1 were written: the resumed run starts from block 2's saved inputs
    assert [p for p in loads if ".layers." in p] == ["model.layers.2", "model.layers.3"]
    fresh = tmp_path / "fresh"
    convert(llama4, fresh, SPEC)
    assert _shards(out) == _shards(fresh)
    assert not (out / STATES_DIR).exists() and not partial.exists()
    manifest = json.loads((out / "tq_manifest.json").read_text())
    assert manifest["shards"] == json.loads((fresh / "tq_manifest.json").read_text())["shards"]

"""The last raw exceptions of the library's face: each is a one-line tq error now."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tq_cli
from tq_cli.app import app
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import SourceError, TqError, UnsupportedError


@pytest.mark.parametrize("bad", [42, None, 1.5, ["a"]])
def test_load_of_something_that_is_not_a_path(bad: object) -> None:
    with pytest.raises(TqError, match=r"^tq_cli.load: path: expected the folder tq convert "
                       r"wrote \(a str or os.PathLike\), got "):
        tq_cli.load(bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tq_bert(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bert") / "tq"
    convert(tiny_bert, out, ConvertSpec(fast=True))
    return out


def test_kv_bits_on_an_encoder_is_refused(tq_bert: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"^tq_cli.load: kv_bits: BertModel does not "
                       r"generate \(the KV cache serves generate\(\)\); load it without "
                       r"kv_bits$"):
        tq_cli.load(tq_bert, kv_bits=4)


def test_a_kv_cache_for_an_encoder_is_refused(tq_bert: Path) -> None:
    model = tq_cli.load(tq_bert)
    with pytest.raises(UnsupportedError, match=r"^KV cache settings: model: BertModel does "
                       r"not generate; the KV cache serves generate\(\) of a decoder$"):
        tq_cli.kv_cache(model)


@pytest.mark.parametrize("value", ["garbage", "2", "maybe"])
def test_tq_compile_that_is_neither_on_nor_off_is_refused(tq_bert: Path, value: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_COMPILE", value)
    with pytest.raises(TqError, match=rf"^TQ_COMPILE='{value}': expected 1 or 0 "):
        tq_cli.load(tq_bert)


@pytest.mark.parametrize("value", ["0", "off", "FALSE", " no "])
def test_tq_compile_off_spellings(tq_bert: Path, value: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_cli.runtime.compiled import default_on

    monkeypatch.setenv("TQ_COMPILE", value)
    assert default_on() is False


def test_eval_against_a_pickled_reference_names_the_fix(tiny_llama: Path, tmp_path: Path) -> None:
    ref = tmp_path / "bin-only"
    ref.mkdir()
    for f in tiny_llama.iterdir():
        if not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, ref / f.name)
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in tiny_llama.glob("*.safetensors"):
        state.update(load_file(shard))
    torch.save(state, ref / "pytorch_model.bin")
    out = tmp_path / "tq"
    convert(tiny_llama, out, ConvertSpec(fast=True))
    r = CliRunner().invoke(app, ["eval", str(out), "--reference", str(ref), "--json"])
    assert r.exit_code != 0
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: {ref}: its weights are only in pickled .bin files; "
                                "tq reads safetensors"), r.output
    assert "internal error" not in r.output
    from tq_cli.runtime.hf_models import load_plain

    with pytest.raises(SourceError, match="save_pretrained"):
        load_plain(ref, torch.device("cpu"))
    assert json.loads((ref / "config.json").read_text())  # the reference is untouched


def test_a_load_racing_an_overwrite_sees_one_checkpoint_whole(tiny_llama: Path,
                                                              tmp_path: Path) -> None:
    """`--overwrite` swaps the finished folder into place; loads that overlap the swap used
    to fail once in 80 ("shard missing"). Each load now gives the old model or the new."""
    import threading

    from tq_cli.io.output import swap_into_place
    from tq_cli.quant.spec import RotationSpec

    ids = torch.arange(3, 15)[None]
    versions = []
    for seed in (0, 1):
        folder = tmp_path / f"v{seed}"
        convert(tiny_llama, folder, ConvertSpec(fast=True, rotation=RotationSpec(seed=seed)))
        with torch.no_grad():
            versions.append((folder, tq_cli.load(folder, compile=False)(ids).logits))
    assert not torch.equal(versions[0][1], versions[1][1])
    out = tmp_path / "out"
    shutil.copytree(versions[0][0], out)
    stop = threading.Event()

    def swapper() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            partial = tmp_path / "out.partial"
            shutil.copytree(versions[i % 2][0], partial)
            swap_into_place(partial, out)
            stop.wait(0.15)  # one overwrite after another, each a whole conversion's end

    t = threading.Thread(target=swapper)
    t.start()
    try:
        for _ in range(25):
            with torch.no_grad():
                got = tq_cli.load(out, compile=False)(ids).logits
            assert any(torch.equal(got, want) for _, want in versions)
    finally:
        stop.set()
        t.join()

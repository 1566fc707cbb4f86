"""A checkpoint loads exactly as `tq convert` wrote it, or refuses to load, naming why.

Each case alters a converted tiny Llama the way a user, a bad copy or an adversary
would, and where it matters "reseals" it (recomputes the shard checksums and the
manifest digest), so that the structural checks themselves are what must catch it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.io.integrity import manifest_digest
from tq_cli.io.writer import file_sha256
from tq_cli.quant.spec import QuantSpec

INDEX = "model.safetensors.index.json"
HOW = "the checkpoint was altered or damaged; convert again or re-download it"


@pytest.fixture(scope="module")
def converted(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "tq"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=3, group_size=64),
                                         max_shard_bytes=60_000))
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _reseal(folder: Path) -> None:
    """Make the checksums and the manifest digest agree with whatever is there now."""
    man = _json(folder / "tq_manifest.json")
    man["shards"] = {s: file_sha256(folder / s) for s in man["shards"]}
    (folder / "tq_manifest.json").write_text(json.dumps(man))
    cfg = _json(folder / "config.json")
    cfg["quantization_config"]["manifest_sha256"] = manifest_digest(man)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_manifest(folder: Path, fn: Callable[[dict], None]) -> None:
    man = _json(folder / "tq_manifest.json")
    fn(man)
    (folder / "tq_manifest.json").write_text(json.dumps(man))


def _entry(man: dict, name: str) -> dict:
    return next(t for t in man["tensors"] if t["name"] == name)


Q = "model.layers.0.self_attn.q_proj.weight"


def test_a_clean_checkpoint_loads(converted: Path) -> None:
    tq_cli.load(converted, device="cpu")


def test_index_pointing_at_an_extra_shard_is_refused(converted: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = _copy(converted, tmp_path)
    save_file({"model.norm.weight": torch.zeros(96)}, d / "extra.safetensors")
    index = _json(d / INDEX)
    index["weight_map"]["model.norm.weight"] = "extra.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    with pytest.raises(TqError) as e:
        tq_cli.load(d, device="cpu")
    assert str(e.value) == (f"{d / INDEX}: maps 'model.norm.weight' to 'extra.safetensors', "
                            f"a shard the manifest does not list; {HOW}")


def test_edited_manifest_fails_its_digest(converted: Path, tmp_path: Path) -> None:
    d = _copy(converted, tmp_path)
    _edit_manifest(d, lambda m: _entry(m, Q)["spec"].update(bits=4))
    with pytest.raises(TqError, match=r"does not match the manifest_sha256 recorded in "
                                      r"config\.json"):
        tq_cli.load(d, device="cpu")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: _entry(m, Q)["spec"].update(bits=4),
     f"tensor '{Q}.codebook' is F32 [8], the manifest implies F32 [16]"),
    (lambda m: _entry(m, Q)["spec"].update(group_size=32),
     f"tensor '{Q}.scales' is F16 [96, 2], the manifest implies F16 [96, 3]"),
    (lambda m: _entry(m, Q)["rotation"].update(block=32),
     f"tensor '{Q}' names rotation 'hadamard-n96-b64-s0', which does not match its kind, "
     "width, block and seed ('hadamard-n96-b32-s0')"),
    (lambda m: _entry(m, Q)["rotation"].update(id="hadamard-n200-b64-s0"),
     f"tensor '{Q}' names rotation 'hadamard-n200-b64-s0', which does not match"),
    (lambda m: _entry(m, Q).update(action="keep"),
     f"maps '{Q}.codebook', which the manifest does not list"),
    (lambda m: m["tensors"].remove(_entry(m, Q)),
     f"maps '{Q}.codebook', which the manifest does not list"),
    (lambda m: m.pop("tensors"), "invalid manifest at 'tensors': Field required"),
    (lambda m: m.pop("shards"), "invalid manifest at 'shards': Field required"),
    (lambda m: _entry(m, Q).update(shape="96x96"),
     "invalid manifest at 'tensors.IDX.shape': Input should be a valid list"),
])
def test_resealed_manifest_edits_are_caught_by_the_headers(
        converted: Path, tmp_path: Path, edit: Callable[[dict], None], message: str) -> None:
    d = _copy(converted, tmp_path)
    if "IDX" in message:  # the entry's position in the list
        names = [t["name"] for t in _json(d / "tq_manifest.json")["tensors"]]
        message = message.replace("IDX", str(names.index(Q)))
    _edit_manifest(d, edit)
    if "Field required" not in message:
        _reseal(d)
    with pytest.raises(TqError) as e:
        tq_cli.load(d, device="cpu")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_damaged_shard_header_names_the_shard(converted: Path, tmp_path: Path) -> None:
    d = _copy(converted, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[10:14] = b"\xff\xfe{{"
    shard.write_bytes(bytes(data))
    with pytest.raises(TqError) as e:
        tq_cli.load(d, device="cpu")
    assert str(e.value) == f"{shard.name}: header is not valid JSON; re-download the file"


def test_from_pretrained_runs_the_same_checks(converted: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    d = _copy(converted, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(TqError, match=f"{shard.name}: checksum mismatch"):
        AutoModelForCausalLM.from_pretrained(d)


def test_manifest_digest_ignores_eval_results(converted: Path) -> None:
    man = _json(converted / "tq_manifest.json")
    assert manifest_digest(man | {"eval": [{"metrics": {"kl_mean": 0.1}}]}) == \
        manifest_digest(man)
    assert _json(converted / "config.json")["quantization_config"]["manifest_sha256"] == \
        manifest_digest(man)


def test_plain_transformers_refuses_to_load_without_tq(converted: Path) -> None:
    """Without `import tq_cli`, transformers meets the guard tensor where a weight should
    be and raises, instead of returning a model with random projections."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from transformers import AutoModelForCausalLM\n"
            "try:\n"
            f"    AutoModelForCausalLM.from_pretrained({str(converted)!r})\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n"
            "    sys.exit(0)\n"
            "assert 'tq_cli' not in sys.modules\n"
            "sys.exit('loaded a tq checkpoint without tq')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ignore_mismatched_sizes" in r.stdout
    man = _json(converted / "tq_manifest.json")
    assert _entry(man, man["guard"])["action"] == "quantize"
    assert f"{man['guard']}" in r.stdout + r.stderr


def test_with_tq_the_guard_loads_silently(converted: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    assert not info["mismatched_keys"], info
    assert not any(n.endswith("q_proj.weight") for n, _ in model.named_parameters())

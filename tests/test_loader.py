"""tq_cli.load and from_pretrained on converted tiny models, and the loader's errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError
from tq_cli.io.checkpoint import Checkpoint
from tq_cli.quant.grouped import dequantize
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu as cpu_kernel


def _close(got: torch.Tensor, want: torch.Tensor, cpu_gemm: str, bf16_tol: float) -> None:
    """Float32 products match the dequantized model to float32 rounding; bf16 ones (three
    roundings of 2^-9 per product, through a few layers) to bf16_tol of the largest
    output, set at about 4x the error measured on these models."""
    if cpu_kernel.available():
        assert cpu_kernel.gemm_precision() == (
            "bf16" if cpu_gemm == "bf16" and cpu_kernel.native_bf16_gemm() else "fp32")
    tol = {"atol": 1e-4, "rtol": 1e-4} if cpu_gemm == "fp32" else {
        "atol": bf16_tol * float(want.abs().max()), "rtol": 0.0}
    assert torch.allclose(got, want, **tol), (got - want).abs().max()


@pytest.fixture(scope="module", params=["hadamard", "orthogonal"])
def llama_tq(request: pytest.FixtureRequest, tiny_llama: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ld") / f"llama-{request.param}"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=3, group_size=64),
                                         rotation=RotationSpec(kind=request.param)))
    return out


def _dequantized_reference(cls: type, source: Path, ck_folder: Path) -> torch.nn.Module:
    model = cls.from_pretrained(source, dtype=torch.float32).eval()
    ck = Checkpoint(ck_folder)
    state = {e["name"]: dequantize(ck.quantized(e["name"])) for e in ck.manifest["tensors"]
             if e["action"] == "quantize"}
    prefix = model.base_model_prefix + "."
    state = {(k if k in model.state_dict() else prefix + k): v for k, v in state.items()}
    missing = set(state) - set(model.state_dict())
    assert not missing
    model.load_state_dict(state, strict=False)
    return model


def test_llama_logits_match_dequantized_model(llama_tq: Path, tiny_llama: Path,
                                              cpu_gemm: str) -> None:
    from transformers import LlamaForCausalLM

    model = tq_cli.load(llama_tq, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, TQLinear)]
    native = {"cpu-avx512", "cpu-avx2", "cpu-scalar"} if cpu_kernel.available() else {"torch"}
    assert len(layers) == 15 and all(m.backend in native for m in layers)  # and lm_head
    assert set(model.tq_report["backends"]) <= native
    assert model.tq_report["cpu_gemm"] == (cpu_kernel.gemm_precision()
                                           if cpu_kernel.available() else None)
    ref = _dequantized_reference(LlamaForCausalLM, tiny_llama, llama_tq)
    ids = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    _close(got, want, cpu_gemm, 2.0**-6)  # 22 rows: the kernel's GEMM path; 2^-8 seen


def test_bert_embeddings_match_dequantized_model(tiny_bert: Path, tmp_path: Path,
                                                 cpu_gemm: str) -> None:
    from transformers import BertModel

    out = tmp_path / "bert-tq"
    convert(tiny_bert, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=32)))
    model = tq_cli.load(out, device="cpu")
    assert sum(isinstance(m, TQLinear) for m in model.modules()) == 12
    ref = _dequantized_reference(BertModel, tiny_bert, out)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).last_hidden_state, ref(ids).last_hidden_state
    _close(got, want, cpu_gemm, 2.0**-10)  # 2^-11.9 seen


def test_from_pretrained_builds_tq_layers(llama_tq: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_tq)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, TQLinear) and layer.rotation is not None
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        assert torch.allclose(model(torch.tensor([[1, 2, 3]])).logits,
                              tq_cli.load(llama_tq)(torch.tensor([[1, 2, 3]])).logits)


def test_tq_linear_dequantize_and_memory(llama_tq: Path) -> None:
    model = tq_cli.load(llama_tq)
    layer = model.model.layers[1].mlp.down_proj
    want = dequantize(Checkpoint(llama_tq).quantized("model.layers.1.mlp.down_proj.weight"))
    assert torch.allclose(layer.dequantize(), want, atol=1e-5)
    # 3-bit codes + fp16 scales per 64 + codebook + 0.1% outliers, well under fp16's 2 bytes.
    assert layer.memory_bytes() < 0.3 * layer.in_features * layer.out_features * 2
    rep = model.tq_report
    assert rep["layers"] == 15 and rep["packed_bytes"] < 0.3 * rep["fp16_bytes"]
    assert rep["tq_bytes"] == rep["packed_bytes"] + rep["rotation_bytes"]


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_not_a_checkpoint(tiny_llama: Path) -> None:
    with pytest.raises(TqError, match=r"not a tq checkpoint \(no tq_manifest.json\); convert "
                                      "it with `tq convert`"):
        tq_cli.load(tiny_llama)


def test_newer_format_is_refused(llama_tq: Path, tmp_path: Path) -> None:
    d = _copy(llama_tq, tmp_path)
    man = json.loads((d / "tq_manifest.json").read_text())
    man["format_version"] = 4
    (d / "tq_manifest.json").write_text(json.dumps(man))
    with pytest.raises(TqError, match="format version 4 is newer than this tq reads "
                                      r"\(3\); upgrade tq"):
        tq_cli.load(d)


def test_checksum_mismatch_names_the_shard(llama_tq: Path, tmp_path: Path) -> None:
    d = _copy(llama_tq, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(TqError, match=f"{shard.name}: checksum mismatch"):
        tq_cli.load(d)


def test_rotation_material_must_match_seed(llama_tq: Path, tmp_path: Path) -> None:
    # Material altered in the shard, and everything that hashes it resealed to match:
    # only the comparison with a fresh draw from the seed can catch it.
    from safetensors.torch import load_file, save_file

    from tq_cli.io.integrity import manifest_digest
    from tq_cli.io.writer import file_sha256

    d = _copy(llama_tq, tmp_path)
    man = json.loads((d / "tq_manifest.json").read_text())
    rid = next(iter(man["rotations"]))
    key = man["rotations"][rid]["keys"][0]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = -tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    man["shards"][shard.name] = file_sha256(shard)
    (d / "tq_manifest.json").write_text(json.dumps(man))
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["manifest_sha256"] = manifest_digest(man)
    (d / "config.json").write_text(json.dumps(config))
    seed = man["rotations"][rid]["seed"]
    with pytest.raises(TqError, match=f"rotation material '{rid}' does not match its seed {seed}"):
        tq_cli.load(d)


def test_edited_manifest_is_refused(llama_tq: Path, tmp_path: Path) -> None:
    d = _copy(llama_tq, tmp_path)
    man = json.loads((d / "tq_manifest.json").read_text())
    man["rotations"][next(iter(man["rotations"]))]["seed"] = 12345
    (d / "tq_manifest.json").write_text(json.dumps(man))
    with pytest.raises(TqError, match=r"tq_manifest\.json: does not match the manifest_sha256 "
                                      r"recorded in config\.json"):
        tq_cli.load(d)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_request_on_cpu_machine(llama_tq: Path) -> None:
    with pytest.raises(TqError, match="no CUDA device is available; use device cpu or auto"):
        tq_cli.load(llama_tq, device="cuda")


def test_converted_tensor_that_is_not_a_linear_is_refused(tmp_path: Path) -> None:
    """GPT-2 keeps its projections in Conv1D modules: the conversion is refused before
    anything is written, instead of a checkpoint that could not be loaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100,
                               n_positions=32)).save_pretrained(src)
    out = tmp_path / "gpt2-tq"
    with pytest.raises(TqError, match=r"none of the tensors recipe 'generic' converts can run "
                                      r"quantized \(it is 'weight' of Conv1D, not the weight "
                                      r"of an nn.Linear\); tq runs converted nn.Linear layers "
                                      r"only"):
        convert(src, out, ConvertSpec(quant=QuantSpec(group_size=32)))
    assert not out.exists()

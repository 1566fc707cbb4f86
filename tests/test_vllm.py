"""tq checkpoints in vLLM (tq_cli/vllm_plugin): same tokens as tq_cli.load, TP=2 = TP=1,
a quantized lm_head (tied to the input embedding or not), and one-line refusals for
checkpoints vLLM cannot split or merge.

The engine tests are marked `vllm` and skip without vLLM; `make vllm-test` builds a venv
with vLLM's CPU build and runs them. vLLM runs in a child process
(scripts/vllm_generate.py), as a deployment would, and greedy tokens are compared with
a greedy loop over `tq_cli.load` in this process. The slicing tests at the top need no
vLLM and run with the main suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tq_cli.vllm_plugin import split
from tq_kernels.packing import pack_codes, unpack_codes

ROOT = Path(__file__).resolve().parents[1]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make vllm-test)")
PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11, 12], [200, 3], [64, 65, 66, 67, 68, 69]]
NEW_TOKENS = 16


# --- slicing, no vLLM needed -------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_slice_codes_cuts_rows_and_whole_columns(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (6, 200), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    for cols in [(0, 200), (0, 64), (64, 128), (128, 200)]:
        got = split.slice_codes(packed, bits, 200, (2, 5), cols)
        assert torch.equal(unpack_codes(got, bits, cols[1] - cols[0]),
                           codes[2:5, cols[0]:cols[1]])


def test_slice_outliers_keeps_and_reindexes_only_the_share() -> None:
    out, n = 4, 10
    idx = torch.tensor([0, 9, 13, 25, 38], dtype=torch.int32)  # (0,0) (0,9) (1,3) (2,5) (3,8)
    val = torch.tensor([1, 2, 3, 4, 5], dtype=torch.float16)
    i, v = split.slice_outliers(idx, val, n, (1, 3), (0, n))  # rows 1-2
    assert i.tolist() == [3, 15] and v.tolist() == [3, 4]
    i, v = split.slice_outliers(idx, val, n, (0, out), (5, 10))  # columns 5-9
    assert i.tolist() == [4, 10, 18] and v.tolist() == [2, 4, 5]
    assert i.dtype == torch.int32


def test_split_sizes_and_refusal_line() -> None:
    assert split.working_tp_sizes(1536, 128, 128) == [1, 2, 3, 4, 6, 12]
    assert split.working_tp_sizes(576, 128, 128) == [1]
    assert split.working_tp_sizes(576, 64, 64) == [1, 3, 9]
    assert split.working_tp_sizes(384, 128, None) == [1, 3]
    assert split.split_refusal("model.layers.0.mlp.down_proj", 384, 2, 128, 128) == (
        "tq: cannot split model.layers.0.mlp.down_proj for tensor_parallel_size=2: its input "
        "width 384 (192 columns per rank) must give every rank whole groups (group size 128) "
        "and whole rotation blocks (rotation block 128); tensor_parallel_size values that "
        "work for this layer: 1, 3")


def test_shard_rows_follow_vllm_kv_head_replication() -> None:
    assert split.shard_rows(256, 128, 1, 2) == (128, 256)
    assert split.shard_rows(128, 64, 3, 4) == (64, 128)  # 2 kv shards over 4 ranks
    assert split.shard_rows(128, 128, 1, 2) == (0, 128)  # replicated


def test_slice_rotation_gives_each_rank_its_blocks() -> None:
    signs = torch.arange(200, dtype=torch.int8)
    assert split.slice_rotation("hadamard", {"signs": signs}, 200,
                                (64, 128))["signs"].tolist() == list(range(64, 128))
    m, t = torch.eye(64), torch.eye(8)
    assert set(split.slice_rotation("orthogonal", {"matrix": m, "tail": t}, 200, (0, 64))) == {
        "matrix"}
    assert set(split.slice_rotation("orthogonal", {"matrix": m, "tail": t}, 200,
                                    (128, 200))) == {"matrix", "tail"}


# --- vLLM engine --------------------------------------------------------------------------


def _tiny_llama(folder: Path, intermediate: int = 512, vocab: int = 320,
                tied: bool = False) -> Path:
    """A 2-layer Llama with head_dim 64 (vLLM's CPU attention refuses 16)."""
    from tinymodels import save_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=intermediate,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=tied,
                      initializer_range=0.08)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    save_tiny_tokenizer(folder, vocab)
    return folder


def _convert(source: Path, out: Path, recipe: str | None = None, bits: int = 4,
             rotation: str = "hadamard", group_size: int = 128,
             head_bits: int | str | None = "default") -> Path:
    from tq_cli.conversion.converter import ConvertSpec, convert
    from tq_cli.quant.spec import QuantSpec, RotationSpec

    # --fast: these tests are about serving (and vLLM's venv has no accelerate, which
    # self-calibration needs to run the model). head_bits "default": convert's default (an
    # 8-bit head); None keeps the head as the source has it.
    head = {"head_bits": head_bits} if head_bits != "default" else {}
    convert(source, out, ConvertSpec(quant=QuantSpec(bits=bits, group_size=group_size),
                                     recipe=recipe, device="cpu", fast=True,
                                     rotation=RotationSpec(kind=rotation), **head))
    return out


def _head_entry(folder: Path) -> dict:
    """The manifest's entry of the converted lm_head."""
    tensors = json.loads((folder / "tq_manifest.json").read_text())["tensors"]
    return next(e for e in tensors if e.get("head"))


def _tq_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """tq's own greedy tokens, with float32 products as `_vllm` runs vLLM (a one-row
    decode GEMV would otherwise take bf16 products where the CPU has them)."""
    import tq_cli
    from tq_kernels import cpu

    cpu.set_gemm_precision("fp32")
    try:
        model = tq_cli.load(folder, device="cpu")
        out = []
        with torch.no_grad():
            for p in prompts:
                res = model(torch.tensor([p]), use_cache=True)
                toks: list[int] = []
                for _ in range(n):
                    toks.append(int(res.logits[0, -1].argmax()))
                    res = model(torch.tensor([[toks[-1]]]),
                                past_key_values=res.past_key_values, use_cache=True)
                out.append(toks)
    finally:
        cpu.set_gemm_precision(None)
    return out


def _cpu_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks: vLLM's "auto" wants one NUMA node per rank,
    which a small machine does not have, so the allowed cores are shared out by hand."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(len(cpus) // tp, 1)
    return "|".join(",".join(map(str, (cpus[r * per:(r + 1) * per] or cpus[-1:])))
                    for r in range(tp))


def _vllm(folder: Path, tmp: Path, tp: int = 1, prompts: list[list[int]] = PROMPTS,
          expect_ok: bool = True, eager: bool = True) -> tuple[dict, str]:
    """Greedy tokens from vLLM in a child process. eager skips torch.compile (one to three
    minutes per start on 2 cores); one test runs the compiled default."""
    ids, res = tmp / f"prompts-{tp}.json", tmp / f"result-{tp}.json"
    ids.write_text(json.dumps(prompts))
    res.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM prefills all prompts as one batch (21+ rows: the CPU kernel's GEMM path) while
    # _tq_greedy prefills each alone (under 16 rows: the float32 GEMV). With bf16 GEMM
    # products the two differ by bf16 rounding, which can flip a near-tie greedy token;
    # float32 products make them agree to float32 rounding, so tokens compare exactly.
    env["TQ_CPU_GEMM"] = "fp32"
    if tp > 1 and not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_bind(tp))
    cmd = [sys.executable, str(ROOT / "scripts" / "vllm_generate.py"), str(folder),
           "--prompt-ids", str(ids), "--tp", str(tp), "--max-tokens", str(NEW_TOKENS),
           "--out", str(res)]
    proc = subprocess.run(cmd + (["--enforce-eager"] if eager else []), env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, log[-6000:]
        return json.loads(res.read_text()), log
    assert proc.returncode != 0, "vLLM loaded a checkpoint it should have refused"
    return {}, log


@pytest.fixture(scope="module")
def tiny_tq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("vllm-tiny")
    # the head as the source has it: served by vLLM's own layers beside tq's
    return _convert(_tiny_llama(tmp / "src"), tmp / "tq4", head_bits=None)


@pytest.fixture(scope="module")
def tiny_tp1(tiny_tq: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # vLLM's default, torch.compile, once: it traces tq's op (the others run eager).
    return _vllm(tiny_tq, tmp_path_factory.mktemp("tp1"), tp=1, eager=False)[0]


@pytest.mark.vllm
@requires_vllm
def test_tiny_llama_same_tokens_as_tq_load(tiny_tq: Path, tiny_tp1: dict) -> None:
    assert tiny_tp1["tokens"] == _tq_greedy(tiny_tq, PROMPTS, NEW_TOKENS)


@pytest.mark.vllm
@requires_vllm
def test_tiny_llama_tp2_same_tokens_as_tp1(tiny_tq: Path, tiny_tp1: dict,
                                           tmp_path: Path) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on CUDA needs two GPUs")
    two, _ = _vllm(tiny_tq, tmp_path, tp=2)
    assert two["tokens"] == tiny_tp1["tokens"]


@pytest.mark.vllm
@requires_vllm
def test_orthogonal_3bit_tp2_same_tokens_as_tq_load(tmp_path: Path) -> None:
    # The other rotation kind and a two-plane code width, split over two ranks: each
    # rank gets its own packed columns, blocks and outliers of o_proj and down_proj. And
    # an untied lm_head stored at 4 bits (vLLM's ParallelLMHead, its vocabulary rows split
    # over the ranks: tq_cli/vllm_plugin/vocab.py).
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on CUDA needs two GPUs")
    folder = _convert(_tiny_llama(tmp_path / "src"), tmp_path / "tq3", bits=3,
                      rotation="orthogonal", head_bits=4)
    head = _head_entry(folder)
    assert (head["name"], head["spec"]["bits"], head.get("embedding")) == (
        "lm_head.weight", 4, None)
    got, _ = _vllm(folder, tmp_path, tp=2)
    assert got["tokens"] == _tq_greedy(folder, PROMPTS, NEW_TOKENS)


@pytest.mark.vllm
@requires_vllm
def test_tp2_refuses_a_checkpoint_it_cannot_split(tmp_path: Path) -> None:
    # down_proj reads 384 columns: 192 per rank is not whole groups of 128.
    folder = _convert(_tiny_llama(tmp_path / "src", intermediate=384), tmp_path / "tq4")
    _, log = _vllm(folder, tmp_path, tp=2, expect_ok=False)
    line = split.split_refusal("model.layers.0.mlp.down_proj", 384, 2, 128, 128)
    assert line in log


@pytest.mark.vllm
@requires_vllm
def test_merged_parts_with_different_specs_are_refused(tmp_path: Path) -> None:
    recipe = tmp_path / "mixed.toml"
    recipe.write_text("\n".join([
        'name = "mixed"', 'description = "k_proj at 3 bits"', 'model_types = ["llama"]',
        'input_groups = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]',
        "[[rules]]", 'pattern = "*.self_attn.k_proj.weight"', "bits = 3",
        "[[rules]]", 'pattern = "*.self_attn.[qvo]_proj.weight"',
        "[[rules]]", 'pattern = "*.mlp.*_proj.weight"', ""]))
    folder = _convert(_tiny_llama(tmp_path / "src"), tmp_path / "tq4", recipe=str(recipe))
    _, log = _vllm(folder, tmp_path, expect_ok=False)
    rid = "hadamard-n256-b128-s0"
    assert ("tq: cannot load model.layers.0.self_attn.qkv_proj: vLLM merges its parts into "
            "one layer, but they were converted with different specs (q_proj: 4 bits, group "
            f"128, rotation {rid}, column scales; k_proj: 3 bits, group 128, rotation {rid}, "
            f"column scales; v_proj: 4 bits, group 128, rotation {rid}, column scales); "
            "convert them with the same bits, group size, rotation and column scaling") in log


@pytest.mark.vllm
@requires_vllm
def test_tied_8bit_head_tp2_same_tokens_as_tq_load(tmp_path: Path) -> None:
    # lm_head tied to the input embedding and stored once at 8 bits (format version 3):
    # vLLM's embedding looks rows up from it and its lm_head computes logits from it.
    # A vocabulary of 300 is padded to 320, so rank 1 holds rows 160-299 and 20 of
    # padding; the prompts look up rows of both ranks.
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on CUDA needs two GPUs")
    folder = _convert(_tiny_llama(tmp_path / "src", vocab=300, tied=True), tmp_path / "tq4",
                      head_bits=8)
    head = _head_entry(folder)
    assert (head["name"], head["embedding"], head["spec"]["bits"]) == (
        "model.embed_tokens.weight", "model.embed_tokens", 8)
    prompts = [*PROMPTS, [299, 161, 159, 250]]
    got, _ = _vllm(folder, tmp_path, tp=2, prompts=prompts)
    assert got["tokens"] == _tq_greedy(folder, prompts, NEW_TOKENS)


@pytest.mark.vllm
@requires_vllm
def test_vocab_method_finds_the_tied_head_and_refuses_in_one_line() -> None:
    # No engine: which vLLM layers get tq's vocabulary method, and the lines a checkpoint
    # vLLM cannot serve that way stops with.
    from types import SimpleNamespace

    from torch import nn

    from tq_cli.errors import UnsupportedError
    from tq_cli.vllm_plugin.info import LayerInfo
    from tq_cli.vllm_plugin.vocab import EMBEDDING, HEAD, TIED_HEAD, TQVocabMethod, vocab_method

    info = LayerInfo(bits=8, group_size=128, out_features=300, in_features=256,
                     rotation="hadamard-n256-b128-s0", block=128, tied=True)
    config = SimpleNamespace(tensors={"model.embed_tokens": info})
    emb = SimpleNamespace(org_vocab_size=300, embedding_dim=256)
    # LlamaModel builds its embedding without a prefix; another model names it
    assert vocab_method(config, emb, "", head=False).role == EMBEDDING
    assert vocab_method(config, emb, "model.embed_tokens", head=False).role == EMBEDDING
    assert vocab_method(config, SimpleNamespace(org_vocab_size=320, embedding_dim=256), "",
                        head=False) is None
    tied = vocab_method(config, emb, "lm_head", head=True)
    assert tied.role == TIED_HEAD
    with pytest.raises(UnsupportedError) as err:
        tied.tie_weights(nn.Module(), nn.Module())
    assert str(err.value) == (
        "tq: model.embed_tokens.weight: the checkpoint stores lm_head as the input "
        "embedding's weight, but vLLM ties lm_head to a Module that tq did not build from "
        "it (quant method NoneType); convert with --head-bits none")
    with pytest.raises(UnsupportedError, match=r"built an untied lm_head .*--head-bits none$"):
        tied.process_weights_after_loading(nn.Module())
    with pytest.raises(UnsupportedError) as err:
        TQVocabMethod(config, "model.embed_tokens", info, EMBEDDING).create_weights(
            SimpleNamespace(org_vocab_size=320), 256, [320], 256, 320, torch.float32)
    assert str(err.value) == (
        "tq: model.embed_tokens.weight: stored as 300 x 256, vLLM builds SimpleNamespace of "
        "320 x 256; "
        "the checkpoint does not match its config.json (vocab_size, hidden_size): convert the "
        "model again")
    untied = SimpleNamespace(tensors={"lm_head": LayerInfo(
        bits=4, group_size=128, out_features=300, in_features=256, rotation=None, block=0)})
    assert vocab_method(untied, emb, "lm_head", head=True).role == HEAD
    assert vocab_method(untied, emb, "", head=False) is None


def _tiny_mixtral(folder: Path) -> Path:
    """A 2-layer Mixtral (4 experts, top-2) with head_dim 32, as vLLM's CPU attention needs."""
    from tinymodels import save_tiny_tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False,
                        initializer_range=0.08)
    MixtralForCausalLM(cfg).save_pretrained(folder)
    save_tiny_tokenizer(folder, 320)
    return folder


@pytest.mark.vllm
@requires_vllm
def test_a_moe_with_kept_experts_same_tokens_as_tq_load(tmp_path: Path) -> None:
    recipe = tmp_path / "keep-experts.toml"
    recipe.write_text('name = "keep-experts"\n[[rules]]\npattern = "*.experts.*"\n'
                      'action = "keep"\n[[rules]]\npattern = "*.self_attn.*_proj.weight"\n')
    folder = _convert(_tiny_mixtral(tmp_path / "src"), tmp_path / "tq4", recipe=str(recipe),
                      group_size=32)
    got, _ = _vllm(folder, tmp_path)
    assert got["tokens"] == _tq_greedy(folder, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def mixtral_tq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("vllm-mixtral")
    return _convert(_tiny_mixtral(tmp / "src"), tmp / "tq4", group_size=32)


@pytest.mark.vllm
@requires_vllm
def test_converted_experts_same_tokens_as_tq_load(mixtral_tq: Path, tmp_path: Path) -> None:
    # vLLM's default, torch.compile: the routed experts are one custom op (tq_moe).
    got, _ = _vllm(mixtral_tq, tmp_path, eager=False)
    assert got["tokens"] == _tq_greedy(mixtral_tq, PROMPTS, NEW_TOKENS)


@pytest.mark.vllm
@requires_vllm
def test_converted_experts_tp2_same_tokens_as_tq_load(mixtral_tq: Path, tmp_path: Path) -> None:
    # Each rank holds half of every expert's intermediate dimension: gate and up rows,
    # down's columns (whole groups and rotation blocks), and the runner sums the halves.
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 on CUDA needs two GPUs")
    got, _ = _vllm(mixtral_tq, tmp_path, tp=2)
    assert got["tokens"] == _tq_greedy(mixtral_tq, PROMPTS, NEW_TOKENS)


def _tiny_qwen2_moe(folder: Path) -> Path:
    """Qwen2-MoE: routed experts beside a shared expert and its one-output gate."""
    from tinymodels import save_tiny_tokenizer
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=128, shared_expert_intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=False, initializer_range=0.08)
    Qwen2MoeForCausalLM(cfg).save_pretrained(folder)
    save_tiny_tokenizer(folder, 320)
    return folder


@pytest.mark.vllm
@requires_vllm
def test_qwen2_moe_same_tokens_as_tq_load(tmp_path: Path) -> None:
    # Converted routed experts, a converted shared expert, a kept shared-expert gate. (A
    # VLM is not tried here: vLLM imports torchvision for every multimodal model, and PyPI
    # has only CUDA builds of it, which fail to load beside the CPU torch.)
    folder = _convert(_tiny_qwen2_moe(tmp_path / "src"), tmp_path / "tq4", group_size=32)
    got, _ = _vllm(folder, tmp_path)
    assert got["tokens"] == _tq_greedy(folder, PROMPTS, NEW_TOKENS)


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n",
]


@pytest.mark.vllm
@pytest.mark.realmodel
@requires_vllm
def test_smollm2_4bit_tied_8bit_head_same_tokens_as_tq_load(smollm2: Path,
                                                             tmp_path: Path) -> None:
    # SmolLM2 ties lm_head to its input embedding: with --head-bits 8 the checkpoint holds
    # the one tensor quantized, which vLLM reads as both (a head kept as the source has it
    # is served by vLLM's own layers: `tiny_tq`).
    from transformers import AutoTokenizer

    folder = _convert(smollm2, tmp_path / "smol-tq4-head8", head_bits=8)
    head = _head_entry(folder)
    assert (head["name"], head["embedding"], head["spec"]["bits"]) == (
        "model.embed_tokens.weight", "model.embed_tokens", 8)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(t)["input_ids"] for t in SMOL_PROMPTS]
    ref = _tq_greedy(folder, prompts, NEW_TOKENS)
    got, _ = _vllm(folder, tmp_path, prompts=prompts)
    assert got["tokens"] == ref

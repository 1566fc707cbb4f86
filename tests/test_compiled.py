"""The compiled CPU decode step (tq_cli.runtime.compiled): the same greedy tokens as the
eager model, the operator's shape-only implementation, the static cache's buckets, and
clean refusals where it cannot serve a model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.errors import TqError, UnsupportedError
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.runtime import compiled
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu as cpu_kernel

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="needs the CPU kernel")
IDS = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def llama_tq(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "llama"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=64), fast=True))
    return out


def test_compiled_generate_gives_the_eager_tokens(llama_tq: Path) -> None:
    eager = tq_cli.load(llama_tq, device="cpu", compile=False)
    model = tq_cli.load(llama_tq, device="cpu", compile=True)
    assert model.tq_compiled and not hasattr(eager, "tq_compiled")
    with torch.no_grad():
        want = eager.generate(IDS, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        out = model.generate(IDS, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             return_dict_in_generate=True)
        again = model.generate(IDS, max_new_tokens=41, min_new_tokens=41, do_sample=False)
    assert torch.equal(out.sequences, want)
    assert torch.equal(again[:, :-1], want)  # a longer call in the same bucket
    from transformers import StaticCache

    assert isinstance(out.cache, StaticCache) and out.cache.layers[0].max_cache_len == 256
    assert getattr(model, "_compiled_call", None) is not None  # transformers compiled it
    assert model.config._attn_implementation == compiled.ATTENTION  # grouped heads in place
    from tq_cli.kvcache.cache import code_attention_because

    assert code_attention_because(model) is None  # a KV cache still attends on its codes


def test_decode_attention_reads_grouped_heads_in_place(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """One query token in a compiled graph: attention over the key/value heads as they
    are, never repeated for every query head (what transformers' sdpa records there):
    SDPA's enable_gqa, equal bit for bit to sdpa over the repeated heads, or tq's operator
    over the cached positions only, equal to float rounding; anything else is
    transformers' sdpa itself."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True  # type: ignore[assignment]
    q, k, v = (torch.randn(1, h, t, 16, generator=g) for h, t in ((6, 1), (2, 40), (2, 40)))
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    mask[..., 30:] = False

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor
             ) -> torch.Tensor:
        return compiled.decode_attention(module, q, k, v, m, scaling=0.25)[0]

    want = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask, scale=0.25).transpose(1, 2)
    for native in (False, True):
        monkeypatch.setattr(compiled, "_native_attention", native)
        torch._dynamo.reset()
        got = torch.compile(step, backend="eager", fullgraph=True)(q, k, v, mask)
        if native:
            assert torch.allclose(got, want, atol=1e-6)
        else:
            assert torch.equal(got, want)
    eager = step(q, k, v, mask)  # outside a graph: transformers' own
    assert torch.equal(eager, sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0])
    assert torch.allclose(eager, want, atol=1e-6)


def test_the_operator_traces_with_its_shape_only_implementation(llama_tq: Path) -> None:
    model = tq_cli.load(llama_tq, device="cpu", compile=False)
    layer = next(m for m in model.modules() if isinstance(m, TQLinear))
    w, rot = layer.weight, layer.rotation
    assert rot is not None
    x = torch.randn(3, layer.in_features)
    args = (x, rot.signs, rot.block, w.codes, w.scales, w.codebook, w.outlier_idx,
            w.outlier_val, layer.bias, layer.bits, layer.group_size, layer.out_features,
            *cpu_kernel.native_args())
    torch.library.opcheck(torch.ops.tq_cpu.linear.default, args)
    torch.library.opcheck(torch.ops.tq_cpu.rotate.default, (x, rot.signs, rot.block))
    # the compiled forward records the operator with the eager layer's result
    layer.prepare_native(cpu_kernel.native_args())
    assert torch.equal(torch.compile(layer, backend="eager")(x), layer(x))


def test_guards_skipped_only_for_module_tensor_checks() -> None:
    """The decode step's guard filter drops dynamo's tensor checks on the modules'
    parameters and buffers (the fingerprint compares them once per generate() call) and
    nothing else: type checks, and the inputs' and cache's tensors, stay."""
    from types import SimpleNamespace

    layer = "args[0]._modules['model']._modules['layers']._modules['3']._modules['mlp']"
    entries = [SimpleNamespace(guard_type=t, name=n) for t, n in [
        ("TENSOR_MATCH", f"{layer}._modules['up_proj']._modules['weight']._buffers['codes']"),
        ("TENSOR_MATCH", f"{layer}._modules['up_proj']._modules['weight']._buffers['scales']"),
        ("TENSOR_MATCH", "args[0]._modules['tq']._modules['r576']._buffers['signs']"),
        ("TENSOR_MATCH", f"{layer}._modules['up_proj']._modules['weight']._buffers['codebook']"),
        ("TENSOR_MATCH", f"{layer}._modules['up_proj']._buffers['col_scale']"),  # x * t: traced
        ("TYPE_MATCH", f"{layer}._modules['up_proj']._modules['weight']._buffers['codes']"),
        ("TYPE_MATCH", f"{layer}._modules['up_proj']"),
        ("TENSOR_MATCH", "kwargs['input_ids']"),
        ("TENSOR_MATCH", "kwargs['cache'].layers[0].keys"),
        ("TENSOR_MATCH", f"{layer}._modules['up_proj']._buffers['codes_extra']"),
        ("TENSOR_MATCH", f"{layer}._parameters['weight']"),
    ]]
    assert compiled.skip_module_tensor_guards(entries) == [False] * 5 + [True] * 4 + [False] * 2
    options = compiled.compile_options()
    assert options.get("guard_filter_fn", compiled.skip_module_tensor_guards) is (
        compiled.skip_module_tensor_guards)


def test_a_parameter_replaced_after_compiling_is_honoured(
        llama_tq: Path, caplog: pytest.LogCaptureFixture) -> None:
    """dynamo no longer checks the modules' tensors before every step: a parameter
    replaced between generate() calls by one with other strides (which a compiled kernel,
    traced for contiguous memory, would misread) changes the fingerprint, so that call
    runs eagerly and gives the eager model's tokens."""
    model = tq_cli.load(llama_tq, device="cpu", compile=True)
    eager = tq_cli.load(llama_tq, device="cpu", compile=False)
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    with torch.no_grad():
        first = model.generate(IDS, **kw)
        for m in (model, eager):
            norm = m.model.norm
            spread = torch.zeros(norm.weight.shape[0], 2)
            spread[:, 0] = norm.weight.detach() * torch.linspace(0.2, 3, norm.weight.shape[0])
            norm.weight = torch.nn.Parameter(spread[:, 0], requires_grad=False)  # stride 2
        with caplog.at_level(logging.INFO, logger="tq"):
            got = model.generate(IDS, **kw)
        want = eager.generate(IDS, **kw)
    assert any("runs eagerly: the model changed after its decode step compiled" in
               r.getMessage() for r in caplog.records)
    assert torch.equal(got, want) and not torch.equal(got, first)


def test_repeated_steps_skip_guards_only_between_like_steps() -> None:
    """Within one generate() call, a step whose inputs look like the last one's (shapes,
    dtypes, the same cache object) runs with dynamo's guards skipped; the first step and
    any step whose inputs changed run with every guard."""
    from torch._dynamo import eval_frame

    skipped: list[bool] = []
    steps = compiled.RepeatedSteps(
        lambda **kw: skipped.append(eval_frame._stance.skip_guard_eval_unsafe))
    cache, other = object(), object()
    one = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache": cache, "use_cache": True}
    for kwargs in (one, one, one, {**one, "input_ids": torch.zeros(2, 1, dtype=torch.long)},
                   {**one, "cache": other}, {**one, "cache": other}, {**one, "use_cache": False}):
        steps(**kwargs)
    assert skipped == [False, True, True, False, False, True, False]
    assert not eval_frame._stance.skip_guard_eval_unsafe  # restored after each step


def test_a_model_changed_between_calls_is_checked_again(llama_tq: Path) -> None:
    """Guards skipped between the steps of one generate() call still run on the first
    step of the next: an lm_head swapped between calls (for one that forces token 7)
    takes effect, and putting the original back gives the first call's tokens again."""

    class Forced(torch.nn.Module):
        def __init__(self, head: torch.nn.Module) -> None:
            super().__init__()
            self.head = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.head(x).clone()
            out[..., 7] = 1e4
            return out

    model = tq_cli.load(llama_tq, device="cpu", compile=True)
    head, n = model.lm_head, IDS.shape[1]
    with torch.no_grad():
        first = model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        model.lm_head = Forced(head)
        forced = model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        model.lm_head = head
        again = model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert (forced[0, n:] == 7).all()
    assert torch.equal(again, first) and not (first[0, n:] == 7).all()


def test_cache_buckets() -> None:
    assert [compiled.bucket(n) for n in (1, 256, 257, 1000, 5000)] == [256, 256, 512, 1024,
                                                                       8192]


def test_where_it_cannot_compile(llama_tq: Path, tiny_llama: Path, tmp_path: Path,
                                 caplog: pytest.LogCaptureFixture,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TqError, match=r"^tq_cli\.load: compile: the TurboQuant KV cache "
                                      r"\(kv_bits\) runs eagerly; pass compile=False or no "
                                      r"kv_bits$"):
        tq_cli.load(llama_tq, device="cpu", kv_bits=4, compile=True)
    with pytest.raises(TqError, match=r"^tq_cli\.load: compile: Input should be a valid "
                                      "boolean$"):
        tq_cli.load(llama_tq, device="cpu", compile="yes")  # type: ignore[arg-type]
    ortho = tmp_path / "ortho"
    convert(tiny_llama, ortho, ConvertSpec(quant=QuantSpec(bits=4, group_size=64), fast=True,
                                           rotation=RotationSpec(kind="orthogonal")))
    with pytest.raises(UnsupportedError, match=r"^tq_cli\.load: compile: orthogonal "
                                               r"rotations run a dense matmul before the "
                                               r"kernel; pass compile=False$"):
        tq_cli.load(ortho, device="cpu", compile=True)
    monkeypatch.setenv("TQ_COMPILE", "1")  # the default outside the test suite
    with caplog.at_level(logging.INFO, logger="tq"):
        model = tq_cli.load(ortho, device="cpu", compile=None)
    assert not hasattr(model, "tq_compiled")
    assert "generate() runs eagerly: orthogonal rotations" in caplog.text
    kv = tq_cli.load(llama_tq, device="cpu", kv_bits=4)  # the default: kv_bits wins
    assert not hasattr(kv, "tq_compiled")


def test_default_follows_tq_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("TQ_COMPILE", value)
        assert compiled.default_on() is on


def test_head_quantized_as_it_loads(tiny_llama: Path, tmp_path: Path) -> None:
    """lm_head 8-bit: the tied embedding reads the same packed weight; logits within the
    head's own quantization error; the compiled step gives the eager tokens."""
    from tq_cli.runtime.head import TQEmbedding

    llama_tq = tmp_path / "kept-head"  # a checkpoint that keeps its head as the source has it
    convert(tiny_llama, llama_tq, ConvertSpec(quant=QuantSpec(bits=4, group_size=64),
                                              fast=True, head_bits=None))

    plain = tq_cli.load(llama_tq, device="cpu", compile=False)
    model = tq_cli.load(llama_tq, device="cpu", compile=False, head_bits=8)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, TQLinear) and head.bits == 8
    # levels on an integer grid: the CPU kernel decodes them without a table lookup
    assert torch.equal(head.weight.codebook, torch.arange(256, dtype=torch.float32) - 127.5)
    info = model.tq_report["head"]
    tied = plain.config.tie_word_embeddings
    assert info["tied"] == tied and info["rel_error"] < 1e-4
    assert info["bytes"] < 0.3 * info["fp_bytes"]
    if tied:  # the embedding rows are the head's dequantized rows, one tensor for both
        assert isinstance(emb, TQEmbedding) and emb.head is head
        ids = torch.tensor([[0, 5, 319]])
        assert torch.allclose(emb(ids)[0], head.dequantize()[ids[0]], atol=1e-5)
    with torch.no_grad():
        want, got = plain(IDS).logits, model(IDS).logits
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.01, rel
    fast = tq_cli.load(llama_tq, device="cpu", compile=True, head_bits=8)
    with torch.no_grad():
        a = model.generate(IDS, max_new_tokens=16, do_sample=False)
        b = fast.generate(IDS, max_new_tokens=16, do_sample=False)
    assert torch.equal(a, b)
    with pytest.raises(TqError, match=r"^tq_cli\.load: head_bits: Input should be 4 or 8$"):
        tq_cli.load(llama_tq, device="cpu", head_bits=3)


def test_a_tied_head_and_embedding_share_one_packed_weight() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tq_cli.runtime.head import TQEmbedding, quantize_head

    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        want = model(IDS).logits
        table = model.model.embed_tokens.weight.clone()
    info = quantize_head(model, 8)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert info["tied"] and isinstance(emb, TQEmbedding) and emb.head is head
    rows = head.dequantize()
    assert torch.allclose(emb(IDS)[0], rows[IDS[0]], atol=1e-6)
    assert float((rows - table).norm() / table.norm()) < 0.01
    with torch.no_grad():
        got = model(IDS).logits
    assert float((got - want).norm() / want.norm()) < 0.02
    with pytest.raises(UnsupportedError, match="head_bits must be one of 4, 8, got 2"):
        quantize_head(model, 2)


def test_a_scaled_embedding_is_not_tied_and_dequantize_reties() -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tq_cli.runtime.head import TQEmbedding, quantize_head

    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64, tie_word_embeddings=True)
    model = Gemma3ForCausalLM(cfg).eval()
    emb = model.get_input_embeddings()
    assert emb.weight is model.lm_head.weight and type(emb) is not torch.nn.Embedding
    info = quantize_head(model, 8)
    # Gemma scales its lookups by sqrt(hidden): the embedding stays as it was
    assert not info["tied"] and model.get_input_embeddings() is emb
    # a head quantized as it loaded comes back tied by dequantize()
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=128,
                                        intermediate_size=256, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=True)).eval()
    quantize_head(tied, 8)
    assert isinstance(tied.get_input_embeddings(), TQEmbedding)
    from tq_cli.runtime.hf_quantizer import dequantize_model

    dequantize_model(tied)
    assert type(tied.get_input_embeddings()) is torch.nn.Embedding
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight


def test_a_hook_or_attribute_added_after_compiling_is_honoured(
        llama_tq: Path, caplog: pytest.LogCaptureFixture) -> None:
    """dynamo does not guard hooks: a forward hook registered after the decode step
    compiled used to reach the prompt's forward only. Now that call runs eagerly (with a
    log line) and gives the hooked eager model's tokens; removing the hook compiles
    again. A plain attribute a forward reads is honoured the same way."""
    def force(_m: torch.nn.Module, _a: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., 7] = 1e4
        return out

    model = tq_cli.load(llama_tq, device="cpu", compile=True)
    n, kw = IDS.shape[1], {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    with torch.no_grad():
        first = model.generate(IDS, **kw)
        handle = model.lm_head.register_forward_hook(force)
        with caplog.at_level(logging.INFO, logger="tq"):
            hooked = model.generate(IDS, **kw)
        handle.remove()
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tq"):
            again = model.generate(IDS, **kw)
    assert (hooked[0, n:] == 7).all()
    assert any("runs eagerly: the model changed after its decode step compiled" in m
               for m in said)
    assert torch.equal(again, first) and not caplog.records  # compiled again, no fallback
    eager = tq_cli.load(llama_tq, device="cpu", compile=False)
    with torch.no_grad():
        for m in (model, eager):
            m.model.layers[0].self_attn.scaling = 0.0  # an attribute its forward reads
        changed = model.generate(IDS, **kw)
        want = eager.generate(IDS, **kw)
    assert torch.equal(changed, want) and not torch.equal(changed, first)


def test_tq_compile_garbage_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQ_COMPILE", "garbage")
    with pytest.raises(TqError, match="TQ_COMPILE='garbage': expected 1 or 0"):
        compiled.default_on()


def test_a_number_a_forward_turns_into_a_tensor_is_not_a_change() -> None:
    """Qwen2-VL's rope_deltas start as None and become a tensor in the first forward; a
    dynamic rotary table's length turns from an int into a tensor: neither is a change
    the compiled step misses, so neither sends generate() to the eager path."""
    m = torch.nn.Linear(2, 2)
    m.rope_deltas = None
    m.max_seq_len_cached = 128
    m.scaling = 0.5
    first = compiled.fingerprint(m)
    m.rope_deltas = torch.zeros(1)
    m.max_seq_len_cached = torch.tensor(256)
    assert not compiled.changed(first, compiled.fingerprint(m))
    m.scaling = 0.25
    assert compiled.changed(first, compiled.fingerprint(m))
    m.scaling = 0.5
    m.register_forward_hook(lambda *a: None)
    assert compiled.changed(first, compiled.fingerprint(m))


def test_no_compiler_for_inductor_keeps_the_eager_step(llama_tq: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prebuilt wheel runs tq's kernels with no C++ compiler, but inductor needs one for
    the compiled step: generate() then decodes eagerly instead of failing."""
    from tq_kernels import cpu_build

    model = tq_cli.load(llama_tq, device="cpu", compile=False)
    assert compiled.why_not_compiled(model) is None
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    assert compiled.why_not_compiled(model) == (
        "no C++ compiler for inductor (tq's kernels came prebuilt); install g++ or set CXX "
        "for the compiled step")

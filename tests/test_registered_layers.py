"""Layers registered with the CPU kernel (csrc/registry.inc): called by handle, the same
result as the operator that takes the packed tensors, bit for bit; replaced under the same
handle; refused once unregistered; and TQLinear's registration follows the module's
tensors and lifetime."""

from __future__ import annotations

import copy
import functools
import gc
from pathlib import Path

import pytest
import torch

import tq_cli
from tq_cli.conversion.converter import ConvertSpec, convert
from tq_cli.quant.grouped import QuantizedTensor
from tq_cli.quant.prepare import quantize
from tq_cli.quant.rotation import make_rotation
from tq_cli.quant.spec import QuantSpec, RotationSpec
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the CPU kernel")
OUT, N, GROUP = 40, 576, 64


@functools.cache
def _quantized(bits: int, seed: int = 0) -> QuantizedTensor:
    w = torch.randn(OUT, N, generator=torch.Generator().manual_seed(bits + 10 * seed))
    return quantize(w, QuantSpec(bits=bits, group_size=GROUP, outliers=0.004),
                    RotationSpec(kind="none"))


def _signs() -> torch.Tensor:
    rot = make_rotation(RotationSpec(kind="hadamard", seed=3), N, 64)
    assert rot.signs is not None
    return rot.signs


def _operands(q: QuantizedTensor, signs: torch.Tensor | None, bias: torch.Tensor | None
              ) -> tuple:
    return (signs, 64 if signs is not None else 0, q.codes, q.scales, q.codebook,
            q.outlier_idx, q.outlier_val, bias)


def _register(q: QuantizedTensor, signs: torch.Tensor | None, bias: torch.Tensor | None,
              native: tuple[int, int, bool, bool], handle: int = -1) -> int:
    return cpu.register(*_operands(q, signs, bias), bits=q.spec.bits, group_size=GROUP,
                        in_features=N, out_features=OUT, native=native, handle=handle)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 17])  # 17: the GEMM path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("products", ["fp32", "bf16"])
def test_registered_layer_gives_the_operator_result_bit_for_bit(
        bits: int, batch: int, dtype: torch.dtype, rotated: bool, products: str) -> None:
    q = _quantized(bits)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, N, generator=g).to(dtype)
    bias = torch.randn(OUT, generator=g)
    signs = _signs() if rotated else None
    isa, gemm_min_batch, _, _ = cpu.native_args()
    native = (isa, gemm_min_batch, products == "bf16", False)
    handle = _register(q, signs, bias, native)
    try:
        got = cpu.linear_registered(x, handle, OUT)
        want = torch.ops.tq_cpu.linear.default(
            x, *_operands(q, signs, bias), bits, GROUP, OUT, *native)
        assert got.dtype == dtype and torch.equal(got, want)
    finally:
        cpu.unregister(handle)


def test_handles_are_replaced_in_place_and_refused_once_unregistered() -> None:
    native = cpu.native_args()
    before = cpu.registered()
    x = torch.randn(1, N, generator=torch.Generator().manual_seed(1))
    a, b = _quantized(4), _quantized(4, seed=1)
    handle = _register(a, _signs(), None, native)
    assert cpu.registered() == before + 1
    first = cpu.linear_registered(x, handle, OUT)
    assert _register(b, _signs(), None, native, handle=handle) == handle
    assert cpu.registered() == before + 1
    second = cpu.linear_registered(x, handle, OUT)
    want = cpu.linear(x, _signs(), 64, b.codes, b.scales, b.codebook, b.outlier_idx,
                      b.outlier_val, None, bits=4, group_size=GROUP, out_features=OUT)
    assert not torch.equal(first, second) and torch.allclose(second, want, rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match=f"layer {handle} has {OUT} outputs, not 7"):
        cpu.linear_registered(x, handle, 7)
    with pytest.raises(RuntimeError, match=f"x has 8 features, layer {handle} takes {N}"):
        cpu.linear_registered(torch.randn(1, 8), handle, OUT)
    cpu.unregister(handle)
    assert cpu.registered() == before
    other = _register(a, _signs(), None, native)  # a freed handle is never given again
    assert other != handle
    with pytest.raises(RuntimeError, match=f"no layer registered as {handle}"):
        cpu.linear_registered(x, handle, OUT)
    cpu.unregister(other)
    with pytest.raises(RuntimeError, match=f"no layer registered as {handle} to replace"):
        _register(b, _signs(), None, native, handle=handle)
    cpu.unregister(handle)  # twice: ignored


def test_a_bad_layer_is_refused_when_registered() -> None:
    q = _quantized(4)
    with pytest.raises(RuntimeError, match=r"codes must be uint8 \[40, 288\]"):
        cpu.register(None, 0, q.codes[:, :-1], q.scales, q.codebook, q.outlier_idx,
                     q.outlier_val, None, bits=4, group_size=GROUP, in_features=N,
                     out_features=OUT)


def test_the_registered_operator_traces_with_its_shape_only_implementation() -> None:
    handle = _register(_quantized(4), _signs(), None, cpu.native_args())
    try:
        torch.library.opcheck(torch.ops.tq_cpu.linear_registered.default,
                              (torch.randn(3, N), handle, OUT))
    finally:
        cpu.unregister(handle)


@pytest.fixture(scope="module")
def llama_tq(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reg") / "llama"
    convert(tiny_llama, out, ConvertSpec(quant=QuantSpec(bits=4, group_size=64), fast=True))
    return out


def test_tqlinear_registration_follows_its_tensors_and_lifetime(llama_tq: Path) -> None:
    gc.collect()
    before = cpu.registered()
    model = tq_cli.load(llama_tq, device="cpu", compile=False)
    layers = [m for m in model.modules() if isinstance(m, TQLinear)]
    for m in layers:
        m.prepare_native(cpu.native_args())
    del m
    assert cpu.registered() == before + len(layers)
    layer = layers[0]
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(layer, backend="eager")
    old = layer(x)
    assert torch.equal(compiled(x), old)
    assert not layer.refresh_native()  # nothing replaced
    # a packed tensor replaced by another object: registered again, under the same handle
    handle = layer.__dict__["native_call"][0]
    codes = layer.weight.codes
    layer.weight.codes = torch.flip(codes, dims=[0]).contiguous()
    new = layer(x)  # eagerly: the new codes
    assert not torch.equal(new, old)
    assert torch.equal(compiled(x), old)  # the compiled forward reads the registration
    assert layer.refresh_native() and layer.__dict__["native_call"][0] == handle
    assert torch.equal(compiled(x), new)
    # written in place (as load_state_dict does): registered again, re-checked
    layer.weight.codes.copy_(codes)
    assert layer.refresh_native() and torch.equal(compiled(x), old)
    layer.weight.outlier_idx.copy_(layer.weight.outlier_idx.flip(0))
    if layer.weight.outlier_idx.numel() > 1:
        with pytest.raises(RuntimeError, match="outlier_idx must be strictly ascending"):
            layer.refresh_native()
        layer.weight.outlier_idx.copy_(layer.weight.outlier_idx.flip(0))
        assert layer.refresh_native()
    layer.prepare_native(None)  # unregistered now
    assert cpu.registered() == before + len(layers) - 1
    del model, layers, layer, compiled
    gc.collect()
    assert cpu.registered() == before


def test_a_copied_layer_registers_itself(llama_tq: Path) -> None:
    """copy.deepcopy of a registered layer carries the original's handle in its plain
    settings; its first refresh gives it its own, so the copy keeps working after the
    original goes."""
    gc.collect()
    before = cpu.registered()
    model = tq_cli.load(llama_tq, device="cpu", compile=False)
    layer = next(m for m in model.modules() if isinstance(m, TQLinear))
    layer.prepare_native(cpu.native_args())
    twin = copy.deepcopy(layer)
    assert twin.__dict__["native_call"] == layer.__dict__["native_call"]
    assert twin.refresh_native() and not twin.refresh_native()
    assert twin.__dict__["native_call"] != layer.__dict__["native_call"]
    assert cpu.registered() == before + 2
    del model, layer
    gc.collect()
    assert cpu.registered() == before + 1
    x = torch.randn(2, twin.in_features, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.compile(twin, backend="eager")(x), twin(x))
    del twin
    gc.collect()
    assert cpu.registered() == before


def test_generate_registers_a_replaced_tensor_again(llama_tq: Path) -> None:
    """A packed tensor replaced between two generate() calls of a compiled model: the
    second call registers it again and decodes what the eager model does."""
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(4))
    model = tq_cli.load(llama_tq, device="cpu", compile=True)
    eager = tq_cli.load(llama_tq, device="cpu", compile=False)
    assert model.tq_compiled
    kw = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    with torch.no_grad():
        first = model.generate(ids, **kw)
        for m in (model, eager):
            layer = next(x for x in m.modules() if isinstance(x, TQLinear))
            layer.weight.codes = torch.flip(layer.weight.codes, dims=[0]).contiguous()
        want = eager.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert not torch.equal(want, first)
    assert torch.equal(got, want)

"""A compiled decode step for CPU generation: `generate()` without the interpreter in the way.

An eager decode step of a small model is mostly Python and framework dispatch: per layer,
norms, rotary, attention and seven projections, each a few small torch calls.
`enable_compiled` makes `generate()` of a model loaded by `tq_cli.load` on the CPU run
transformers' own static KV cache and compile the decode step with `torch.compile`
(inductor, which fuses the elementwise work into C++ loops), the way transformers
already does on CUDA:

- each TQLinear records tq's native operator directly, on the layer registered with the
  kernel library beforehand (`TQLinear.prepare_native`: the step passes its activations
  and a handle, not ~1,000 packed tensors; the operator has a shape-only implementation
  for tracing, `tq_kernels.cpu`);
- the static cache is sized in buckets (`bucket`: powers of two from 256 tokens), so a
  later call with a few more tokens reuses the compiled step instead of compiling again;
  a call that may run past MAX_CACHE tokens runs eagerly (a static cache is read whole
  every step);
- a decode step's attention reads the cache's key/value heads as they are
  (`decode_attention`, SDPA's `enable_gqa`) where transformers' sdpa would repeat them
  to every query head inside a compiled graph: copying the whole static cache
  num_key_value_groups times per layer and step;
- dynamo's guards run on a generate() call's first decode step and are skipped on the
  steps after it whose inputs look the same (`RepeatedSteps`);
- the first generate() of a process compiles (about 45 s for SmolLM2 on 2 cores;
  inductor keeps what it built on disk, so later processes take about a quarter of that).

A model it cannot serve keeps the eager path with a log line saying why: not on the
CPU, the native kernel unavailable, an orthogonal rotation (a dense matmul before the
operator), mixture-of-experts layers, or a family transformers does not compile.
`TQ_COMPILE=0` turns the default off for a process; `tq_cli.load(..., compile=False)`
for one model.
"""

from __future__ import annotations

import logging
import os
import re
import types
from typing import Any

import torch
from torch import nn

from tq_cli.errors import TqError
from tq_cli.kvcache.attend import COMPILED_SDPA as ATTENTION
from tq_cli.runtime.tq_linear import TQLinear

log = logging.getLogger("tq")
MIN_CACHE = 256
MAX_CACHE = 8192  # longer generate() calls (or an unset large max_length) run eagerly


def bucket(tokens: int) -> int:
    """The static cache length for a generation of up to `tokens` tokens in all."""
    n = MIN_CACHE
    while n < tokens:
        n *= 2
    return n


def default_on() -> bool:
    """Whether `tq_cli.load` compiles by default in this process (TQ_COMPILE=0: no); a
    value that is neither on nor off is refused, not read as either."""
    raw = os.environ.get("TQ_COMPILE", "1")
    value = raw.strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise TqError(f"TQ_COMPILE={raw!r}: expected 1 or 0 (true/false, yes/no, on/off); unset "
                  "it for the default (on)")


def _inductor_compiler() -> bool:
    """Whether inductor finds a C++ compiler for the step's kernels: $CXX, else c++, g++ or
    clang++ on PATH (a prebuilt tq wheel runs its own kernels without one)."""
    import shutil

    from tq_kernels import cpu_build

    cxx = cpu_build.compiler()
    return cxx is not None and shutil.which(cxx) is not None


def why_not_compiled(model: nn.Module) -> str | None:
    """Why `enable_compiled` cannot serve this model, or None."""
    from tq_cli.runtime.experts import TQExperts
    from tq_kernels import cpu

    layers = [m for m in model.modules() if isinstance(m, TQLinear)]
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not compile {type(model).__name__}"
    if not hasattr(model, "generate"):
        return "the model does not generate"
    if any(isinstance(m, TQExperts) for m in model.modules()):
        return "mixture-of-experts layers run a Python loop over experts"
    if not layers:
        return "no converted layers"
    if any(m.weight.codes.device.type != "cpu" for m in layers):
        return "compiled decode steps are for the CPU (CUDA runs Triton kernels)"
    if not cpu.available():
        return "tq's native CPU kernel is unavailable"
    if not _inductor_compiler():
        return ("no C++ compiler for inductor (tq's kernels came prebuilt); install g++ or set "
                "CXX for the compiled step")
    if not cpu.traceable():
        return "this torch cannot register the operators' shapes for tracing"
    if any(m.rotation is not None and m.rotation.kind != "hadamard" for m in layers):
        return "orthogonal rotations run a dense matmul before the kernel"
    return None


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for one query token inside a compiled graph
    with grouped key/value heads: there transformers' sdpa repeats the cache's heads for
    every query head (on the CPU; eagerly it folds the groups into the query instead, which
    dynamo does not trace). Here they are read in place: by tq's operator over the cached
    positions only (`tq_kernels.cpu.decode_attention`, float32 with a bool mask), else by
    SDPA's `enable_gqa`, with the repeat's result bit for bit (SmolLM2: 9 query heads on 3
    key/value heads, 83 -> 32 us a layer at 256 cached tokens, eagerly, 1 thread)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or groups == 1 or dropout or not torch.compiler.is_compiling()
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                               dropout=dropout, scaling=scaling, **kwargs)
    if (_native_attention and attention_mask is not None
            and attention_mask.dtype == torch.bool and attention_mask.dim() == 4
            and attention_mask.shape[1:3] == (1, 1) and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.float32):
        # only the cached positions (tq_kernels.cpu.decode_attention; called directly, as
        # TQLinear's operator is: a Python check inside the graph would break it)
        out = torch.ops.tq_cpu.decode_attention.default(
            query, key, value, attention_mask,
            query.shape[-1] ** -0.5 if scaling is None else scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


_MODULE_TENSOR = re.compile(r"\._(parameters|buffers)\['[^']+'\]$")


def skip_module_tensor_guards(entries: list[Any]) -> list[bool]:
    """A dynamo guard filter: keep every guard but the tensor checks on the modules'
    parameters and buffers (about 1,400 on SmolLM2), which `fingerprint` takes over:
    compared once per generate() call, not before every step."""
    return [not (e.guard_type == "TENSOR_MATCH" and _MODULE_TENSOR.search(e.name))
            for e in entries]


def compile_options() -> dict[str, Any]:
    """torch.compile's options for the decode step (inductor's settings):

    - the guard filter (`skip_module_tensor_guards`), where this torch has guard filters;
    - no size asserts: inductor's wrapper checks the shape and strides of every graph
      input before every step, 1,400-odd on SmolLM2 (its parameters and buffers), which
      `fingerprint` compares once per generate() call (+7% tokens/s at 2 threads without
      them).
    """
    options: dict[str, Any] = {"size_asserts": False}
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        options["guard_filter_fn"] = skip_module_tensor_guards
    return options


_native_attention = False  # tq's decode_attention operator traceable (set when enabling)


def _register_attention() -> None:
    from transformers import AttentionInterface

    from tq_kernels import cpu

    global _native_attention
    _native_attention = cpu.traceable()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def enable_compiled(model: Any) -> bool:
    """Make `model.generate()` use a static cache and a compiled decode step where it can;
    False (and a log line) where it cannot. Returns whether it did."""
    from transformers.generation.configuration_utils import CompileConfig

    from tq_kernels import cpu

    reason = why_not_compiled(model)
    if reason is not None:
        log.info("tq: generate() runs eagerly: %s", reason)
        return False
    native = cpu.native_args()
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        _register_attention()
        model.set_attn_implementation(ATTENTION)
    for m in model.modules():
        if isinstance(m, TQLinear):
            m.prepare_native(native)
    quantizer = getattr(model, "hf_quantizer", None)  # its compile flag: set per call
    config = CompileConfig(fullgraph=False, dynamic=False, mode="default",
                           options=compile_options())
    config.mode = None  # type: ignore[assignment]  # torch.compile takes a mode or options
    config._compile_all_devices = True  # type: ignore[assignment]  # else accelerators only
    original = model._prepare_cache_for_generation

    def prepare(self: Any, generation_config: Any, model_kwargs: dict, *args: Any,
                **kwargs: Any) -> Any:
        own = (model_kwargs.get("cache") is None and model_kwargs.get("past_key_values") is None
               and generation_config.use_cache is not False
               and generation_config.cache_implementation in (None, "static")
               and not generation_config.disable_compile
               # a static cache is read whole every step: unbounded lengths run eagerly
               and (generation_config.max_length or 0) <= MAX_CACHE
               and self.device.type == "cpu"  # moved to CUDA after loading: eager
               and any(isinstance(m, TQLinear) for m in self.modules()))  # dequantized
        if own:
            seen = fingerprint(self)
            first = self.__dict__.setdefault("_tq_fingerprint", seen)
            if changed(first, seen):  # a hook or attribute the compiled step would miss
                log.info("tq: generate() runs eagerly: the model changed after its decode "
                         "step compiled (a hook, a module or an attribute)")
                own = False
        if own:  # a packed tensor replaced since the last call: register it again
            for m in self.modules():
                if isinstance(m, TQLinear):
                    m.refresh_native()
        if quantizer is not None:  # transformers compiles only what this call allows
            quantizer.compileable = own
        if own:  # set per call: a caller's own cache gets no "cannot compile" warning
            generation_config.compile_config = generation_config.compile_config or config
            generation_config.cache_implementation = "static"
            generation_config.max_cache_len = max(generation_config.max_cache_len or 0,
                                                  bucket(generation_config.max_length))
        return original(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = types.MethodType(prepare, model)
    if _can_skip_guards():
        compiled_call = model.get_compiled_call

        def get_compiled_call(self: Any, compile_config: Any) -> Any:
            step = compiled_call(compile_config)  # transformers' (and its cache of it)
            return RepeatedSteps(step) if compile_config is config else step

        model.get_compiled_call = types.MethodType(get_compiled_call, model)
    model.tq_compiled = True
    return True


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks")


def fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """What an eager forward honours and a compiled step may not notice (dynamo skips its
    guards on hooks): every module's hooks (by handle id), the global ones, the module tree
    (names and types) and each module's plain attributes (numbers, strings, flags; not the
    model's own private ones, where generate() keeps its bookkeeping), and each
    parameter's and buffer's type, shape, strides, dtype, device and requires_grad: dynamo's
    checks of those are filtered out of the step's guards (`skip_module_tensor_guards`),
    so this per-call comparison stands in for them. Values edited in place need no entry:
    the compiled step reads the tensors as inputs."""
    from torch.nn.modules import module as base

    glob = tuple(tuple(getattr(base, n, {}).keys()) for n in _GLOBAL_HOOKS)
    per = []
    for name, m in model.named_modules():
        hooks = tuple(tuple(getattr(m, h, {}).keys()) for h in _MODULE_HOOKS)
        attrs = tuple(sorted((k, v) for k, v in m.__dict__.items()
                             if k != "training" and not (name == "" and k.startswith("_"))
                             and type(v) in (bool, int, float, str)))
        tensors = tuple((k, type(t), tuple(t.shape), t.stride(), t.dtype, t.device,
                         t.requires_grad)
                        for k, t in (*m._parameters.items(), *m._buffers.items())
                        if t is not None)
        per.append((name, (type(m), tensors), hooks, attrs))
    return glob, tuple(per)


def changed(first: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """Whether `now` (a `fingerprint`) differs from `first` in what a compiled step may
    miss: hooks, the module tree, or a plain attribute that is plain in both (one that a
    forward turns from a number into a tensor, as Qwen2-VL's rope_deltas or a dynamic
    rotary table's length, is dynamo's to guard)."""
    if first[0] != now[0] or len(first[1]) != len(now[1]):
        return True
    for (n0, t0, h0, a0), (n1, t1, h1, a1) in zip(first[1], now[1], strict=True):
        if (n0, t0, h0) != (n1, t1, h1):
            return True
        d0, d1 = dict(a0), dict(a1)
        if any(d0[k] != d1[k] for k in d0.keys() & d1.keys()):
            return True
    return False


def _can_skip_guards() -> bool:
    import inspect

    return "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def _signature(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a decode step's inputs look like to its guards, as far as a step of the same
    generate() call can differ: tensors by shape, strides, dtype and device, objects (the
    cache) by identity, plain values by value."""
    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
        return v if isinstance(v, (bool, int, float, str, type(None))) else (type(v), id(v))
    return tuple((k, one(v)) for k, v in sorted(kwargs.items()))


class RepeatedSteps:
    """One generate() call's compiled decode step, with dynamo's guards checked on the first
    step and whenever the inputs' shapes, dtypes or objects change, and skipped on the steps
    between (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, which keeps only the
    guards that tell compiled variants apart, e.g. cache buckets or thread counts).

    Within one generate() call nothing the guards check changes from step to step: the same
    model, cache object, thread count and static shapes; only the values in the tensors
    move. The full check still runs once per call (transformers asks for the compiled step
    once per generate()), so a model changed between calls (a hook, a swapped layer,
    `model.dequantize()`) recompiles or runs eagerly as before. SmolLM2 has about 9,900
    guards; their evaluation was about 1 ms of a 12-14 ms step at 2 threads.
    """

    def __init__(self, step: Any) -> None:
        self.step = step
        self.last: tuple[Any, ...] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = _signature(kwargs) if not args else None
        if sig is not None and sig == self.last:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.step(*args, **kwargs)
        out = self.step(*args, **kwargs)
        self.last = sig
        return out


__all__ = [
    "ATTENTION",
    "RepeatedSteps",
    "bucket",
    "changed",
    "compile_options",
    "decode_attention",
    "default_on",
    "enable_compiled",
    "fingerprint",
    "why_not_compiled",
]

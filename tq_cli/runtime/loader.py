"""`load()`: a tq checkpoint folder (or hub id) in, a runnable transformers model out.

Checks before building anything: it is a tq checkpoint, its format version is one this
tq reads, every shard matches its manifest checksum, and every stored rotation matches
a fresh draw from its seed. The model is then built on the meta device by transformers'
`from_pretrained` with the turboquant quantizer registered (tq_cli.runtime.hf_quantizer), so
converted layers are TQLinear from the start and no full-size weight is ever allocated.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
)
from torch import nn

from tq_cli.device import check_device, resolve_device
from tq_cli.errors import CorruptFileError, TqError, UnsupportedError, first_error
from tq_cli.io.checkpoint import SKIP_CHECKSUMS, check_checkpoint
from tq_cli.io.format import converted_entries
from tq_cli.io.source import resolve_source
from tq_cli.kvcache.spec import MAX_BITS, MIN_BITS, no_bool
from tq_cli.runtime.compiled import default_on, enable_compiled, why_not_compiled
from tq_cli.runtime.hf_models import model_class
from tq_cli.runtime.tq_linear import TQLinear
from tq_kernels import cpu as cpu_kernel

log = logging.getLogger("tq")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype(value: Any) -> torch.dtype | None:
    if value is None or (isinstance(value, torch.dtype) and value in DTYPES):
        return value
    raise ValueError(f"{value!r} is not one tq runs models in; use "
                     f"{', '.join(str(d) for d in DTYPES)} (or None for the default)")


class LoadSpec(BaseModel):
    """`load`'s arguments, validated before anything is read, with the same rules as the
    CLI's (the device of `tq_cli.device`, the KV settings of `KVSpec`): a bad value is one
    TqError naming the argument."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    device: Annotated[Any, BeforeValidator(check_device)] = None
    dtype: Annotated[Any, BeforeValidator(_dtype)] = None
    verify_checksums: StrictBool = True
    kv_bits: Annotated[float | None, BeforeValidator(no_bool)] = Field(None, ge=MIN_BITS,
                                                                          le=MAX_BITS)
    kv_window: StrictInt = Field(128, ge=0)
    compile: StrictBool | None = None
    head_bits: Literal[4, 8] | None = None


def _checked(**args: Any) -> LoadSpec:
    try:
        return LoadSpec(**args)
    except ValidationError as e:
        where, what = first_error(e)
        raise TqError(f"tq_cli.load: {where}: {what}") from None


READ_TRIES = 3  # reads of a folder replaced while it loaded, before the error stands


def _read_retrying(folder: Path, args: LoadSpec, dev: torch.device,
                   dtype: torch.dtype) -> Any:
    """`_read`, again (up to READ_TRIES times) when it fails because the folder was replaced
    while it read (a `tq convert --overwrite` finishing): a reader sees the old checkpoint
    or the new one whole, never a mix or an error about the swap."""
    for attempt in range(READ_TRIES):
        before = _identity(folder)
        try:
            model = _read(folder, args, dev, dtype)
        except Exception:
            if attempt + 1 == READ_TRIES or _identity(folder) == before:
                raise
            log.info("tq: %s was replaced while it loaded; loading it again", folder)
            continue
        if _identity(folder) == before:  # read from one folder throughout: not a mix
            return model
        log.info("tq: %s was replaced while it loaded; loading it again", folder)
    raise CorruptFileError(f"{folder}: replaced {READ_TRIES} times while it loaded; load it "
                           "again once the conversion writing it has finished")


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read(folder: Path, args: LoadSpec, dev: torch.device, dtype: torch.dtype) -> Any:
    """Check the folder and build the model from it."""
    ck = check_checkpoint(folder, args.verify_checksums)
    try:
        from tq_cli.runtime.hf_quantizer import register
    except ImportError as e:
        raise TqError("loading a tq checkpoint needs transformers: pip install 'tq[models]'") from e
    register()

    config = json.loads((folder / "config.json").read_text())
    stored_head = (config.get("quantization_config") or {}).get("head_bits")
    if args.head_bits is not None and stored_head:
        raise UnsupportedError(f"tq_cli.load: head_bits: {folder} stores lm_head quantized "
                               f"already ({stored_head} bits); load it with head_bits=None")
    cls = model_class(config)
    token = SKIP_CHECKSUMS.set(not args.verify_checksums)  # the quantizer checks the folder too
    try:
        model = cls.from_pretrained(folder, dtype=dtype)
    finally:
        SKIP_CHECKSUMS.reset(token)
    model = model.to(dev).eval()
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if t.device.type == "meta"]
    if leftovers:
        raise CorruptFileError(f"{folder}: tensors missing from the checkpoint: "
                               f"{', '.join(leftovers[:5])}")
    layers = [m for m in model.modules() if isinstance(m, TQLinear)]
    for m in layers:
        m.weight.set_dtype(dtype)
    converted = len(converted_entries(ck.manifest))
    if len(layers) != converted:
        # transformers would have initialised the missing layers at random: never return that.
        raise CorruptFileError(
            f"{folder}: {converted} tensors were converted but {len(layers)} TQLinear layers "
            "were built; is tq_cli imported before transformers loads the model?")
    return model


def load(path_or_hub_id: str | os.PathLike[str], device: str | torch.device | None = None,
         dtype: torch.dtype | None = None, verify_checksums: bool = True,
         kv_bits: float | None = None, kv_window: int = 128,
         compile: bool | None = None, head_bits: int | None = None) -> nn.Module:
    """Load a tq checkpoint as a transformers model whose converted layers are TQLinear.

    device: None picks CUDA when available, else CPU; "cuda" without CUDA is an error.
    dtype: of activations and kept tensors; default float16 on CUDA, float32 on CPU.
    kv_bits: when given, `generate()` uses a TurboQuant KV cache at these bits (with
    `kv_window` recent tokens in full precision) unless it is passed a cache.
    compile: `generate()` runs a static KV cache and a compiled decode step
    (`runtime.compiled`; the first call compiles). None (the default): where the model
    allows it (CPU, no kv_bits, not TQ_COMPILE=0), else eagerly with a log line saying why;
    True: refuse a model it cannot serve; False: eagerly.
    head_bits: 8 or 4 quantizes lm_head (and an input embedding tied to it) as it loads
    (`runtime.head`), for a checkpoint that keeps its head (one that stores it quantized,
    `tq convert`'s default, is refused); None runs the head as stored.
    """
    if not isinstance(path_or_hub_id, str | os.PathLike):
        raise TqError(f"tq_cli.load: path: expected the folder tq convert wrote (a str or "
                      f"os.PathLike), got {type(path_or_hub_id).__name__}")
    args = _checked(device=device, dtype=dtype, verify_checksums=verify_checksums,
                    kv_bits=kv_bits, kv_window=kv_window, compile=compile,
                    head_bits=head_bits)
    if args.compile and args.kv_bits is not None:
        raise TqError("tq_cli.load: compile: the TurboQuant KV cache (kv_bits) runs eagerly; "
                      "pass compile=False or no kv_bits")
    auto_compile = args.compile is None and default_on()  # TQ_COMPILE read before any work
    dev = resolve_device(args.device)
    dtype = args.dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    kv_spec = None
    if args.kv_bits is not None:  # checked before any loading
        from tq_cli.kvcache.cache import make_spec

        kv_spec = make_spec(args.kv_bits, args.kv_window)
    folder = resolve_source(path_or_hub_id)
    model = _read_retrying(folder, args, dev, dtype)
    if args.head_bits is not None:
        from tq_cli.runtime.head import quantize_head

        head = quantize_head(model, args.head_bits)
    model.tq_report = report(model)
    model.tq_report["head"] = head if args.head_bits is not None else None
    if kv_spec is not None:
        from tq_cli.kvcache.cache import use_kv_cache

        if not (hasattr(model, "can_generate") and model.can_generate()):
            raise UnsupportedError(f"tq_cli.load: kv_bits: {type(model).__name__} does not "
                                   "generate (the KV cache serves generate()); load it "
                                   "without kv_bits")

        use_kv_cache(model, kv_spec)
    elif args.compile or auto_compile:
        if args.compile and (reason := why_not_compiled(model)) is not None:
            raise UnsupportedError(f"tq_cli.load: compile: {reason}; pass compile=False")
        enable_compiled(model)
    log.info("tq: %d TQLinear layers, backends %s, CPU prefill GEMM %s",
             model.tq_report["layers"],
             dict(model.tq_report["backends"]), model.tq_report["cpu_gemm"] or "-")
    return model


def report(model: nn.Module) -> dict:
    """Backends per layer and the memory of converted layers against fp16."""
    layers = [m for m in model.modules() if isinstance(m, TQLinear)]
    packed = sum(m.memory_bytes() for m in layers)
    holder = getattr(model, "tq", None)
    rot = (sum(b.numel() * b.element_size() for b in holder.buffers())
           if isinstance(holder, nn.Module) else 0)
    fp16 = sum(2 * m.out_features * (m.in_features + (1 if m.bias is not None else 0))
               for m in layers)
    backends = Counter(m.backend for m in layers)
    on_cpu = any(b.startswith("cpu-") for b in backends)
    return {"layers": len(layers), "backends": backends,
            # the product precision of the CPU kernel's prefill GEMM (None: no CPU layers)
            "cpu_gemm": cpu_kernel.gemm_precision() if on_cpu else None,
            "packed_bytes": packed, "rotation_bytes": rot, "tq_bytes": packed + rot,
            "fp16_bytes": fp16}

"""transformers integration: `from_pretrained` on a tq folder builds TQLinear layers.

Registers a `turboquant` quantization config and quantizer through transformers'
public extension points (`register_quantization_config`, `register_quantizer`). Before
weights load, the quantizer reads the folder's manifest and shard headers, swaps each
converted `nn.Linear` for a `TQLinear` whose buffers have the stored shapes and dtypes,
and adds a `model.tq.rotation` module for the shared rotation material, so every key
of the checkpoint is a key of the model and transformers' own loader fills them in.
Importing this module imports transformers; `tq_cli` imports it only when transformers
is (or gets) imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from tq_cli.errors import CorruptFileError, UnsupportedError
from tq_cli.io.checkpoint import check_checkpoint
from tq_cli.io.format import (
    ALL_SUFFIXES,
    FORMAT_VERSION,
    QUANT_METHOD,
    ConvertedEntry,
    converted_entries,
)
from tq_cli.io.manifest import read_manifest
from tq_cli.io.safetensors_reader import DTYPES, read_header
from tq_cli.runtime.source_check import refuse_incomplete
from tq_cli.runtime.tq_linear import PackedWeight, RotationMaterial, TQLinear

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TurboQuantConfig(QuantizationConfigMixin):
    """config.json's `quantization_config` for quant_method "turboquant" (format version 3)."""

    def __init__(self, bits: int = 4, group_size: int = 128,
                 format_version: int = FORMAT_VERSION,
                 modules_to_not_convert: list[str] | None = None, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.format_version = format_version
        self.bits, self.group_size = bits, group_size
        self.modules_to_not_convert = modules_to_not_convert
        for k, v in kwargs.items():
            if k != "quant_method":
                setattr(self, k, v)


def _headers(files: list[str]) -> Specs:
    out: Specs = {}
    for f in files:
        header, _, _ = read_header(Path(f))
        out.update({k: (tuple(v["shape"]), DTYPES[v["dtype"]][0]) for k, v in header.items()})
    return out


def prepare_model(model: nn.Module, folder: Path, headers: Specs) -> nn.Module:
    """Swap converted linears for TQLinear and add the rotation holders (on meta)."""
    manifest = read_manifest(folder)
    prefix = getattr(model, "base_model_prefix", "")
    modules = dict(model.named_modules())
    entries = converted_entries(manifest)
    experts: dict[str, dict[tuple[int, str], tuple[str, TQLinear]]] = {}
    for e in entries:
        if e.expert is not None:  # built below, one TQExperts per MoE layer
            layer = _layer(e, headers, bias=None)
            path = e.module.removeprefix(e.expert.of + ".")
            experts.setdefault(e.expert.of, {})[(e.expert.index, e.expert.role)] = (path, layer)
            continue
        name = _module_name(modules, prefix, e.module)
        if name is None or not isinstance(modules[name], nn.Linear):
            found = type(modules[name]).__name__ if name is not None else "no module"
            raise UnsupportedError(
                f"{folder}: converted tensor '{e.name}' belongs to {found}, not an "
                f"nn.Linear of {type(model).__name__}; tq can only run converted nn.Linear "
                "layers, so convert this model with a recipe that keeps that tensor")
        old = modules[name]
        bias = (headers.get(e.name.removesuffix(".weight") + ".bias")
                if old.bias is not None else None)
        layer = _layer(e, headers, bias)
        model.set_submodule(name, layer)
        if e.embedding is not None:
            _tied_embedding(model, folder, modules, prefix, e, name, layer)
    for of, layers in experts.items():
        _place_experts(model, folder, modules, of, layers)
    rotations = {}
    for rid, info in manifest.get("rotations", {}).items():
        specs = {k.rsplit(".", 1)[1]: headers[k] for k in info["keys"]}
        rotations[rid] = RotationMaterial(info["kind"], info["block"], specs)
    holder = nn.Module()
    holder.rotation = nn.ModuleDict(rotations)
    model.tq = holder
    guard = manifest.get("guard")
    if guard:  # the empty tensor that stops a load without tq (docs/format.md): skip it,
        # under its own name and the name transformers renames it to (a VLM's layers)
        names = {guard} | {f"{e.module}.weight" for e in entries if e.name == guard}
        ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        # nn.Module.__setattr__ is typed for tensors and modules; this is a plain set.
        object.__setattr__(model, "_keys_to_ignore_on_load_unexpected",
                           ignored | {rf"(^|\.){re.escape(n)}$" for n in names})
    return model


def _module_name(modules: dict[str, nn.Module], prefix: str, path: str) -> str | None:
    """The built model's name for a module the manifest names `path` (with or without the
    model's base prefix), or None."""
    return next((n for n in (path, f"{prefix}.{path}", path.removeprefix(prefix + "."))
                 if n in modules), None)


def _tied_embedding(model: nn.Module, folder: Path, modules: dict[str, nn.Module],
                    prefix: str, e: ConvertedEntry, head_name: str, layer: TQLinear) -> None:
    """A head stored once for lm_head and the input embedding tied to it (format 3): the
    embedding becomes a TQEmbedding that holds the packed buffers under the stored keys,
    and transformers is told the two are no longer tied parameters it should tie."""
    from tq_cli.runtime.head import TQEmbedding

    ck = e.embedding or ""
    name = _module_name(modules, prefix, ck)
    old = modules.get(name) if name is not None else None
    if type(old) is not nn.Embedding:
        found = type(old).__name__ if old is not None else "no module"
        raise UnsupportedError(
            f"{folder}: converted tensor '{e.name}' is read by the input embedding "
            f"'{ck}', but {type(model).__name__} has {found} there, not an nn.Embedding; "
            "convert this model with --head-bits none")
    assert name is not None
    model.set_submodule(name, TQEmbedding(layer, old.weight.dtype, owner=True))
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        mine = (f"{head_name}.", f"{name}.")
        object.__setattr__(model, "all_tied_weights_keys", {
            k: v for k, v in tied.items()
            if not (k.startswith(mine) or v.startswith(mine))})


def _layer(e: ConvertedEntry, headers: Specs,
           bias: tuple[tuple[int, ...], torch.dtype] | None) -> TQLinear:
    specs = {suffix: headers[key] for suffix, key in e.keys.items()}
    layer = TQLinear(e.shape[1], e.shape[0], bits=e.spec.bits, group_size=e.spec.group_size,
                     specs=specs, bias=bias)
    layer.tq_rotation_id = e.rotation_id
    return layer


def _place_experts(model: nn.Module, folder: Path, modules: dict[str, nn.Module], of: str,
                   layers: dict[tuple[int, str], tuple[str, TQLinear]]) -> None:
    """Swap the MoE layer `of` for a TQExperts running the converted experts."""
    from tq_cli.runtime.experts import TQExperts, unsupported_because

    old = modules.get(of)
    why = (unsupported_because(old) if old is not None
           else f"{type(model).__name__} has no module '{of}'")
    if old is not None and why is None:
        try:
            model.set_submodule(of, TQExperts(old, layers))
            return
        except ValueError as e:
            why = str(e)
    raise UnsupportedError(f"{folder}: the converted experts of '{of}' cannot run: {why}; "
                           "convert this model with a recipe that keeps them")


def _refuse_random_init(model: nn.Module, folder: Path) -> None:
    """transformers initialises at random what the checkpoint lacks, drops what the model
    lacks, and only logs it. Its report, once it has applied the model's own exceptions
    (`_adjust_missing_and_unexpected_keys`, wrapped on this instance for the one load), is
    refused by name instead (tq_cli.runtime.source_check): a tq checkpoint loads whole or
    not at all. Emptied first, so transformers' own report raises nothing over it."""
    adjust = cast(Callable[[Any], None], model._adjust_missing_and_unexpected_keys)
    cls = type(model).__name__

    def checked(info: Any) -> None:
        adjust(info)
        # A missing buffer other than tq's own is made by the model's constructor (rotary
        # tables), not drawn at random; a tensor the class does not use is only refused
        # when the class is the one config.json names (a base model loaded from a
        # checkpoint with a head drops the head, as transformers intends).
        stored = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                  if isinstance(mod, PackedWeight | RotationMaterial) for b in mod._buffers}
        wanted = {n for n, _ in model.named_parameters()} | stored
        own = cls in (getattr(getattr(model, "config", None), "architectures", None) or [])
        why = refuse_incomplete(str(folder), cls, info, wanted, own)
        if why is not None:
            info.missing_keys, info.unexpected_keys = set(), set()
            info.mismatched_keys = set()
            raise CorruptFileError(why)

    object.__setattr__(model, "_adjust_missing_and_unexpected_keys", checked)


def check_finite(model: nn.Module, folder: Path | str) -> None:
    """Refuse stored floats (scales, column scales, codebooks, outlier values, rotation
    material) that are NaN or infinite: a re-sealed checkpoint's digests match, but tq
    never writes such a value, and it would turn every output into NaN."""
    for name, m in model.named_modules():
        if not isinstance(m, PackedWeight | RotationMaterial):
            continue
        for b, t in m.named_buffers(recurse=False):
            if t.is_floating_point() and t.device.type != "meta" and t.numel() and \
                    not bool(torch.isfinite(t).all()):
                raise CorruptFileError(f"{folder}: stored tensor '{name}.{b}' holds NaN or "
                                       "infinite values, which tq never writes; the "
                                       "checkpoint was altered or damaged; convert again")


def link_rotations(model: nn.Module) -> None:
    """Point each TQLinear at its shared rotation material."""
    holder = getattr(model, "tq", None)
    rotations = (dict(holder.get_submodule("rotation").named_children())
                 if isinstance(holder, nn.Module) else {})
    for m in model.modules():
        if isinstance(m, TQLinear):
            rid = getattr(m, "tq_rotation_id", None)
            rot = rotations.get(rid) if rid else None
            m.set_rotation(rot if isinstance(rot, RotationMaterial) else None)


def dequantize_model(model: Any, dtype: torch.dtype | None = None) -> nn.Module:
    """Every TQLinear back to a plain nn.Linear holding its weight in the original basis.

    The shared rotation holder (`model.tq`) goes too, so the state dict is an ordinary
    model's. dtype: of the new weights (default: float32, the dequantized precision).
    """
    from tq_cli.runtime.experts import TQExperts

    for name, m in list(model.named_modules()):
        if isinstance(m, TQExperts):
            model.set_submodule(name, m.dequantize(dtype))
    for name, m in list(model.named_modules()):
        if not isinstance(m, TQLinear):
            continue
        w = m.dequantize().to(dtype or torch.float32)
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            plain.weight.copy_(w)
            if m.bias is not None:
                plain.bias.copy_(m.bias.to(w.dtype))
        model.set_submodule(name, plain)
    from tq_cli.runtime.head import TQEmbedding

    emb = next((m for m in model.modules() if isinstance(m, TQEmbedding)), None)
    if emb is not None:  # a head quantized as it loaded (tq_cli.runtime.head)
        head = model.get_output_embeddings()
        plain_emb = nn.Embedding(emb.num_embeddings, emb.embedding_dim,
                                 device=head.weight.device, dtype=head.weight.dtype)
        plain_emb.weight = head.weight  # tied again, as before quantizing
        model.set_input_embeddings(plain_emb)
    if isinstance(getattr(model, "tq", None), nn.Module):
        del model.tq
    return model


# A key that goes on with one of tq's stored suffixes (`X.weight.codes`): not the source's.
_STORED = "(?!\\.(?:" + "|".join(ALL_SUFFIXES) + ")(?!\\w))"


def _not_stored(pattern: str) -> str:
    """A converter's source pattern that matches what it matched, except tq's stored keys
    (transformers adds `(?!\\w)` to a pattern ending in a name; it is added here first, as
    the suffix guard ends the pattern otherwise)."""
    if pattern.endswith(_STORED):
        return pattern
    boundary = r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", pattern) else ""
    return pattern + boundary + _STORED


class TurboQuantHfQuantizer(HfQuantizer):
    """Loads pre-quantized tq checkpoints; tq does not quantize inside from_pretrained."""

    requires_calibration = True

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        files = [str(f) for f in kwargs.get("checkpoint_files") or []]
        if not files:
            raise ValueError("tq: from_pretrained on a tq checkpoint needs its safetensors files")
        folder = Path(files[0]).parent
        # The checks tq_cli.load runs (once per folder per process); TQ_SKIP_CHECKSUMS=1
        # skips only the full sha256 read of the shards, never the structural checks.
        check_checkpoint(folder, verify_checksums=not os.environ.get("TQ_SKIP_CHECKSUMS"))
        self.__dict__["_tq_folder"] = folder
        _refuse_random_init(model, folder)
        return prepare_model(model, folder, _headers(files))

    def update_weight_conversions(self, weight_conversions: list[Any],
                                  model: nn.Module | None = None) -> list[Any]:
        """transformers' converters merge per-expert tensors into fused parameters, and
        their patterns end on a name boundary, so `experts.3.w1.weight` also matches the
        stored `experts.3.w1.weight.codes`. Each converter is copied with its patterns
        refusing a key that goes on with one of tq's stored suffixes, so it still merges
        what is kept in full precision (and any converter of a module, `attn.Wqkv`, still
        matches `attn.Wqkv.weight`) and leaves tq's stored tensors to the TQExperts that
        holds them (tq_cli.runtime.experts). (transformers before 5.2x calls this hook
        without the model.)"""
        from transformers.core_model_loading import WeightConverter

        base = (super().update_weight_conversions(weight_conversions)  # type: ignore[call-arg]
                if model is None
                else super().update_weight_conversions(weight_conversions, model))
        out = []
        for c in base:
            if isinstance(c, WeightConverter):
                guarded = type(c)(
                    source_patterns=[_not_stored(p) for p in c._original_source_patterns],
                    target_patterns=list(c._original_target_patterns),
                    operations=list(c.operations))
                for attr in ("scope_prefix", "base_model_prefix", "force_cpu"):
                    if hasattr(c, attr):
                        setattr(guarded, attr, getattr(c, attr))
                c = guarded
            out.append(c)
        return out

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        model.__dict__.pop("_adjust_missing_and_unexpected_keys", None)
        check_finite(model, self.__dict__.get("_tq_folder", "the checkpoint"))
        link_rotations(model)
        # The dtype the model runs in, as its kept parameters have it: what a converted
        # weight's `.dtype` says (tq_cli.runtime.tq_linear.PackedWeight).
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        for m in model.modules():
            if isinstance(m, TQLinear):
                m.weight.set_dtype(dtype)
        return model

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        # transformers' HfQuantizer.dequantize calls this, then drops quantization_config,
        # so model.dequantize() + save_pretrained() writes an ordinary model.
        return dequantize_model(model, dtype)

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    # Set by `tq_cli.load` once every layer records the native CPU operator in a compiled
    # step (`runtime.compiled`); other models are not compiled by generate().
    compileable = False

    @property
    def is_compileable(self) -> bool:
        return self.compileable


def register() -> None:
    """Register with transformers once (registering twice raises there)."""
    if QUANT_METHOD in AUTO_QUANTIZATION_CONFIG_MAPPING:
        return
    register_quantization_config(QUANT_METHOD)(TurboQuantConfig)
    register_quantizer(QUANT_METHOD)(TurboQuantHfQuantizer)


register()

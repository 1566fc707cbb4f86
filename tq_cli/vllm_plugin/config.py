"""vLLM's side of a tq checkpoint: a QuantizationConfig and a linear method.

Imported only by `tq_cli.vllm_plugin.register()` (vLLM's `vllm.general_plugins` entry
point), so nothing else in tq imports vLLM. Written against vLLM 0.32:

- `TQConfig` (vllm/model_executor/layers/quantization/base_config.py,
  `QuantizationConfig`) is registered as method "tq" and claims, through
  `override_quantization_method`, checkpoints whose config.json says
  `quant_method: "turboquant"` (vllm/config/model.py, `_verify_quantization`: custom
  methods are asked first). `maybe_update_config` receives the model folder: the
  manifest is read and tq's own integrity checks run there, once, in the process that
  builds the engine config; the config object then travels pickled to the workers.
- The checkpoint's keys reach the layers through `get_checkpoint_weight_mapper`, which
  `AutoWeightsLoader.load_weights` applies (vllm/model_executor/models/utils.py):
  `X.weight.codes` -> `X.tq_codes` (and scales, codebook, outliers), the guard tensor and
  `tq.rotation.*` dropped. The model's own mapper then stacks q/k/v and gate/up into
  `qkv_proj` / `gate_up_proj` with a shard id.
- `TQLinearMethod` (vllm/model_executor/layers/linear.py, `LinearMethodBase`) declares
  the packed tensors per rank in `create_weights`, cuts each loaded tensor to the rank's
  rows or columns in its weight loader (`tq_cli.vllm_plugin.split`), and in
  `process_weights_after_loading` re-indexes the outliers and attaches the rotation
  material (read from the shards: it is shared, so no layer owns its keys).
- A MoE layer whose experts were converted gets `TQMoEMethod` (`tq_cli/vllm_plugin/moe.py`).
- A converted lm_head, and the input embedding tied to it, get `TQVocabMethod`
  (`tq_cli/vllm_plugin/vocab.py`; vLLM's `VocabParallelEmbedding` and `ParallelLMHead`).
- `apply` is one registered custom op, `torch.ops.vllm.tq_linear`, so torch.compile
  (vLLM compiles the model by default) sees an opaque call with a shape function
  (vllm/utils/torch_utils.py, `direct_register_custom_op`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

import tq_cli.vllm_plugin.split as split
from tq_cli.errors import UnsupportedError
from tq_cli.io.checkpoint import check_checkpoint
from tq_cli.io.format import (
    ALL_SUFFIXES,
    COL_SCALE,
    QUANT_METHOD,
    ROTATION_PREFIX,
    converted_entries,
    stored_key,
)
from tq_cli.io.manifest import read_manifest
from tq_cli.io.safetensors_reader import INDEX_NAME
from tq_cli.io.source import resolve_source
from tq_cli.vllm_plugin.info import LayerInfo, RotationInfo, rank_rotation
from tq_cli.vllm_plugin.state import LAYERS, LayerState, Part, layer_state
from tq_kernels import dispatch
from tq_kernels.packing import packed_row_bytes

METHOD = "tq"
QKV = ("q", "k", "v")


def is_tq_checkpoint(qc: dict[str, Any]) -> bool:
    return qc.get("quant_method") in (QUANT_METHOD, METHOD) and isinstance(
        qc.get("format_version"), int)


class TQConfig(QuantizationConfig):
    """A tq checkpoint's `quantization_config` plus, once the folder is known, its
    manifest: which weights are converted, with what spec and rotation."""

    def __init__(self, quantization_config: dict[str, Any]) -> None:
        super().__init__()
        self.quantization_config = dict(quantization_config)
        self.folder: str | None = None
        self.tensors: dict[str, LayerInfo] = {}
        self.rotations: dict[str, RotationInfo] = {}
        self.guard: str | None = None

    def __repr__(self) -> str:
        return f"TQConfig(folder={self.folder!r}, tensors={len(self.tensors)})"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # Triton's floor; the CPU and the torch reference run anywhere

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything needed is in config.json and the manifest beside it

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TQConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        if is_tq_checkpoint(hf_quant_cfg) and user_quant in (None, METHOD, QUANT_METHOD):
            return METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None,
                            revision: str | None = None) -> None:
        """Read the manifest and run tq's integrity checks (tq_cli.load's own)."""
        folder = resolve_source(model_name, revision)
        check_checkpoint(folder, verify_checksums=not os.environ.get("TQ_SKIP_CHECKSUMS"))
        manifest = read_manifest(folder)
        weight_map = _weight_map(folder)
        self.folder = str(folder.resolve())
        self.guard = manifest.get("guard")
        # vLLM maps checkpoint names itself (hf_to_vllm_mapper): by the source name,
        # not the module transformers renames it to.
        self.tensors = {
            e.name.removesuffix(".weight"): LayerInfo(
                bits=e.spec.bits, group_size=e.spec.group_size, out_features=e.shape[0],
                in_features=e.shape[1], rotation=e.rotation_id, block=e.block,
                expert=(e.expert.index, e.expert.role) if e.expert is not None else None,
                col_scale=e.spec.col_scale != "none", tied=e.embedding is not None)
            for e in converted_entries(manifest)}
        self.rotations = {
            rid: RotationInfo(info["kind"], info["n"], info["block"],
                              {k.rsplit(".", 1)[1]: (weight_map[k], k) for k in info["keys"]})
            for rid, info in manifest.get("rotations", {}).items()}

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """Follow a model's renames (vLLM passes its rename-only mapper)."""
        renamed = {}
        for name, info in self.tensors.items():
            new = hf_to_vllm_mapper.map_name(name + ".weight")
            if new is not None:
                renamed[new.removesuffix(".weight")] = info
        self.tensors = renamed

    def get_checkpoint_weight_mapper(self) -> Any:
        """Checkpoint keys to vLLM parameter names (a vllm...models.utils.WeightsMapper)."""
        from vllm.model_executor.models.utils import WeightsMapper

        drop: dict[re.Pattern[str], str | None] = {}
        if self.guard:  # the empty tensor that stops a load without tq (docs/format.md)
            drop[re.compile(rf"^{re.escape(self.guard)}$")] = None
        return WeightsMapper(
            orig_to_new_regex=drop,
            orig_to_new_prefix={ROTATION_PREFIX: None},
            # X.weight.codes -> X.tq_codes, and so on for every stored suffix
            orig_to_new_suffix={stored_key(".weight", s): f".tq_{s}" for s in ALL_SUFFIXES})

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        if isinstance(layer, VocabParallelEmbedding):  # lm_head too (ParallelLMHead)
            from tq_cli.vllm_plugin.vocab import vocab_method

            return vocab_method(self, layer, prefix, head=isinstance(layer, ParallelLMHead))
        if not isinstance(layer, LinearBase):
            if isinstance(layer, RoutedExperts) and any(
                    n.startswith(prefix + ".") for n in self.tensors):
                from tq_cli.vllm_plugin.moe import TQMoEMethod

                return TQMoEMethod(self, prefix, layer.moe_config)
            return None
        if self.folder is None:
            raise UnsupportedError("tq: the quantization config was not given the model folder "
                                   "(vLLM did not call maybe_update_config)")
        last = prefix.rsplit(".", 1)[-1]
        subs = self.packed_modules_mapping.get(last)
        names = ([prefix.removesuffix(last) + s for s in subs] if subs else [prefix])
        found = [n for n in names if n in self.tensors]
        if not found:
            return UnquantizedLinearMethod()
        if len(found) != len(names):
            kept = [n.rsplit(".", 1)[-1] for n in names if n not in self.tensors]
            raise UnsupportedError(
                f"tq: {prefix}: vLLM merges {', '.join(n.rsplit('.', 1)[-1] for n in names)} "
                f"into one layer, but {', '.join(kept)} {'was' if len(kept) == 1 else 'were'} "
                "kept unconverted; convert all of them or none (a recipe rule)")
        return TQLinearMethod(self, prefix, names)


def _weight_map(folder: Path) -> dict[str, str]:
    import json

    return dict(json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"])


class TQLinearMethod(LinearMethodBase):
    """y = (x R) W_rot^T + outliers + bias for a tq layer, possibly merged and sharded."""

    def __init__(self, config: TQConfig, prefix: str, names: list[str]) -> None:
        self.config, self.prefix, self.names = config, prefix, names

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        infos = [self.config.tensors[n] for n in self.names]
        first = infos[0]
        if any((i.bits, i.group_size, i.rotation, i.col_scale)
               != (first.bits, first.group_size, first.rotation, first.col_scale)
               for i in infos):
            specs = "; ".join(f"{n.rsplit('.', 1)[-1]}: {i.spec()}"
                              for n, i in zip(self.names, infos, strict=True))
            raise UnsupportedError(
                f"tq: cannot load {self.prefix}: vLLM merges its parts into one layer, but "
                f"they were converted with different specs ({specs}); convert them with "
                "the same bits, group size, rotation and column scaling")
        if len(output_partition_sizes) != len(infos) or input_size != first.in_features:
            raise UnsupportedError(
                f"tq: {self.prefix}: vLLM builds it as {len(output_partition_sizes)} part(s) "
                f"of input width {input_size}, the checkpoint has {len(infos)} of width "
                f"{first.in_features}; this model's layout is not supported")
        tp_rank, tp_size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
        n_local = input_size_per_partition
        block = first.block if first.rotation else None
        if n_local != first.in_features:
            ways = first.in_features // n_local
            if not split.row_split_ok(first.in_features, ways, first.group_size, block):
                raise UnsupportedError(split.split_refusal(
                    self.prefix, first.in_features, ways, first.group_size, block))
            cols = (tp_rank * n_local, (tp_rank + 1) * n_local)
        else:
            cols = (0, first.in_features)
        parts, offset = [], 0
        for name, info, out_local in zip(self.names, infos, output_partition_sizes, strict=True):
            rows = split.shard_rows(info.out_features, out_local, tp_rank, tp_size)
            parts.append(Part(name, info, rows, cols, offset))
            offset += out_local
        layer.__dict__["tq_state"] = LayerState(self.prefix, parts, n_local, first.bits,
                                                first.group_size, offset)
        shapes = {
            "codes": ((offset, packed_row_bytes(n_local, first.bits)), torch.uint8),
            "scales": ((offset, -(-n_local // first.group_size)), torch.float16),
            "codebook": ((len(parts), 2 ** first.bits), torch.float32),
            # Outliers are cut once all have arrived (process_weights_after_loading).
            "outlier_idx": ((0,), torch.int32),
            "outlier_val": ((0,), torch.float16),
        }
        if first.col_scale:  # one row of t per part, this rank's input columns
            shapes[COL_SCALE] = ((len(parts), n_local), torch.float16)
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(f"tq_{name}", param)
            set_weight_attrs(param, {"weight_loader": functools.partial(_load, layer, name)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        st = layer_state(layer)
        dev = layer.get_parameter("tq_codes").device
        idx, val = [], []
        st.outlier_starts = [0]
        for p, part in enumerate(st.parts):
            if ("outlier_idx", p) not in st.staged or ("outlier_val", p) not in st.staged:
                raise UnsupportedError(f"tq: {part.name}: outliers missing from the checkpoint")
            i, v = split.slice_outliers(st.staged["outlier_idx", p], st.staged["outlier_val", p],
                                        part.info.in_features, part.rows, part.cols)
            idx.append(i)
            val.append(v)
            st.outlier_starts.append(st.outlier_starts[-1] + i.numel())
        st.staged = {}
        layer.register_parameter("tq_outlier_idx", nn.Parameter(torch.cat(idx).to(dev),
                                                                requires_grad=False))
        layer.register_parameter("tq_outlier_val", nn.Parameter(torch.cat(val).to(dev),
                                                                requires_grad=False))
        first = st.parts[0]
        rid = first.info.rotation
        if rid is not None:
            assert self.config.folder is not None
            st.rotation, st.block = rank_rotation(self.config.folder, rid,
                                                  self.config.rotations[rid], first.cols, dev)
        st.key = f"{self.prefix}#{id(layer)}"
        LAYERS[st.key] = layer

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        st = layer_state(layer)
        y: torch.Tensor = torch.ops.vllm.tq_linear(x, st.key, st.out_features, bias)
        return y


def _part_index(st: LayerState, shard_id: Any) -> int:
    n = len(st.parts)
    if shard_id is None and n == 1:
        return 0
    if isinstance(shard_id, str) and shard_id in QKV and n == 3:
        return QKV.index(shard_id)
    if isinstance(shard_id, int) and 0 <= shard_id < n:
        return shard_id
    raise UnsupportedError(f"tq: {st.prefix}: a checkpoint tensor arrived for shard "
                           f"{shard_id!r}, which tq cannot place (already merged in the "
                           "checkpoint?)")


def _load(layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor,
          shard_id: Any = None) -> None:
    """Weight loader of every tq parameter: cut the full tensor to this rank's share."""
    st = layer_state(layer)
    p = _part_index(st, shard_id)
    part = st.parts[p]
    info = part.info
    if name.startswith("outlier"):
        st.staged[name, p] = loaded.detach().to("cpu", copy=True)
        return
    if name == "codebook":
        param.data[p].copy_(loaded)
        return
    if name == COL_SCALE:
        param.data[p].copy_(loaded[part.cols[0]:part.cols[1]])
        return
    if name == "codes":
        t = split.slice_codes(loaded, info.bits, info.in_features, part.rows, part.cols)
    else:
        t = split.slice_scales(loaded, info.group_size, part.rows, part.cols)
    n = part.rows[1] - part.rows[0]
    dest = param.data[part.offset:part.offset + n]
    if dest.shape != t.shape:
        raise UnsupportedError(f"tq: {part.name}.weight.{name}: shape {tuple(t.shape)} on this "
                               f"rank, expected {tuple(dest.shape)}; the checkpoint does not "
                               "match the model config")
    dest.copy_(t)


def _tq_linear(x: torch.Tensor, key: str, out_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    layer = LAYERS[key]
    st = layer_state(layer)
    codes, scales = layer.get_parameter("tq_codes"), layer.get_parameter("tq_scales")
    codebook = layer.get_parameter("tq_codebook")
    oidx, oval = layer.get_parameter("tq_outlier_idx"), layer.get_parameter("tq_outlier_val")
    kw = {"bits": st.bits, "group_size": st.group_size, "in_features": st.n_local}
    # Column scales (tq_cli.quant.colscale): each part's own t scales x before its rotation.
    t = layer._parameters.get("tq_col_scale")
    if len(st.parts) == 1:  # one call: on CPU the native kernel also rotates (Hadamard)
        xin = dispatch.scale_columns(x, t[0]) if t is not None else x
        y1 = dispatch.linear(xin, st.rotation, st.block, codes, scales, codebook[0], oidx,
                             oval, bias, out_features=out_features, **kw)
        return y1.to(x.dtype)
    x_rot = (dispatch.rotate(x, st.rotation, st.block)
             if t is None and st.rotation is not None else x)
    ys = []
    for p, part in enumerate(st.parts):
        o0, o1 = part.offset, part.offset + part.rows[1] - part.rows[0]
        k0, k1 = st.outlier_starts[p], st.outlier_starts[p + 1]
        xp, rot, block = x_rot, None, 0
        if t is not None:
            xp, rot, block = dispatch.scale_columns(x, t[p]), st.rotation, st.block
        ys.append(dispatch.linear(xp, rot, block, codes[o0:o1], scales[o0:o1], codebook[p],
                                  oidx[k0:k1], oval[k0:k1], None, out_features=o1 - o0, **kw))
    y = torch.cat(ys, dim=-1).to(x.dtype)
    return y + bias.to(y.dtype) if bias is not None else y


def _tq_linear_fake(x: torch.Tensor, key: str, out_features: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@functools.lru_cache(maxsize=1)
def register_op() -> None:
    """`torch.ops.vllm.tq_linear`, `tq_moe` and `tq_embedding`, once per process."""
    from tq_cli.vllm_plugin.moe import register_op as register_moe
    from tq_cli.vllm_plugin.vocab import register_op as register_vocab

    register_moe()
    register_vocab()
    direct_register_custom_op("tq_linear", _tq_linear, mutates_args=[],
                              fake_impl=_tq_linear_fake)

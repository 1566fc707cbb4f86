"""vLLM's side of a converted lm_head and of the input embedding tied to it: `TQVocabMethod`.

`tq convert --head-bits` stores lm_head quantized (tq_cli.quant.head). Where the model ties
lm_head to its input embedding, the one stored tensor is the embedding's
(`model.embed_tokens.weight.codes`, ...; manifest entry with `embedding`, format version 3);
otherwise it is `lm_head.weight.*`. Written against vLLM 0.32
(vllm/model_executor/layers/vocab_parallel_embedding.py):

- `VocabParallelEmbedding.__init__` (and `ParallelLMHead`, its subclass) asks the quant
  config for a method (`resolve_quant_method` -> `TQConfig.get_quant_method`) and calls its
  `create_weights` with the rank's padded row count (`num_embeddings_per_partition`): the
  vocabulary is split by rows over the tensor-parallel ranks, each rank holding the
  original rows `shard_indices.org_vocab_start_index` to `org_vocab_end_index`, then zero
  padding. Rows are whole in a tq weight (codes and scales are per row; the columns, and
  so the groups and rotation blocks, are never split), so every tensor-parallel size works:
  the loader keeps the rank's rows and leaves the padding rows zero (scale 0: logit 0,
  which `LogitsProcessor` cuts off).
- `VocabParallelEmbedding.forward` calls `quant_method.embedding(layer, ids)` with ids local
  to the rank (those of other ranks masked to 0, their rows zeroed and summed over the
  ranks afterwards). Here that is one registered custom op, `torch.ops.vllm.tq_embedding`:
  it dequantizes only the looked-up rows (codes times scales) and undoes the Hadamard
  rotation, as tq_cli.runtime.head.TQEmbedding does in transformers.
- `LogitsProcessor._apply_head` (vllm/model_executor/layers/logits_processor.py) calls
  `lm_head.quant_method.apply(lm_head, hidden, bias)`: tq's linear op,
  `torch.ops.vllm.tq_linear`, the one every converted linear layer runs.
- With `tie_word_embeddings` the model builds `ParallelLMHead` and then calls
  `lm_head.tie_weights(embed_tokens)` (vllm/model_executor/models/llama.py,
  `LlamaForCausalLM.__init__`), which asks the head's method to `tie_weights`: the head then
  shares the embedding's parameters and state, so the packed weight is held once.

The Llama family builds its embedding without a prefix (`LlamaModel.__init__`), so a
VocabParallelEmbedding that asks with an empty prefix is the tied head's when its shape is
the stored weight's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

import tq_cli.vllm_plugin.split as split
from tq_cli.errors import UnsupportedError
from tq_cli.io.format import COL_SCALE
from tq_cli.quant.head import embedding_rows
from tq_cli.vllm_plugin.info import LayerInfo, rank_rotation
from tq_cli.vllm_plugin.state import LAYERS, LayerState, Part, layer_state
from tq_kernels.packing import packed_row_bytes

EMBEDDING, HEAD, TIED_HEAD = "embedding", "head", "tied head"
FIX = "convert with --head-bits none"


class TQVocabMethod(QuantizeMethodBase):
    """A converted vocabulary matrix: the input embedding that holds a tied head's packed
    weight (role "embedding"), an untied lm_head ("head"), or a lm_head that reads the
    embedding's ("tied head": it holds nothing until `tie_weights`)."""

    def __init__(self, config: Any, name: str, info: LayerInfo, role: str) -> None:
        # config: the plugin's TQConfig (not imported as a type: it imports this module)
        self.config, self.name, self.info, self.role = config, name, info, role

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        info = self.info
        vocab = int(getattr(layer, "org_vocab_size", output_size))
        if (vocab, input_size) != (info.out_features, info.in_features) or (
                input_size_per_partition != input_size):
            raise UnsupportedError(
                f"tq: {self.name}.weight: stored as {info.out_features} x {info.in_features}, "
                f"vLLM builds {type(layer).__name__} of {vocab} x {input_size}; the "
                "checkpoint does not match its config.json (vocab_size, hidden_size): "
                "convert the model again")
        layer.__dict__["tq_params_dtype"] = params_dtype
        if self.role == TIED_HEAD:  # the embedding's weight, shared in tie_weights
            return
        rotation = self.config.rotations.get(info.rotation) if info.rotation else None
        if self.role == EMBEDDING and (info.col_scale or rotation is None
                                       or rotation.kind != "hadamard"):
            raise UnsupportedError(
                f"tq: {self.name}.weight: an input embedding tied to lm_head needs a "
                f"Hadamard rotation and no column scales, it has {info.spec()}; reconvert "
                f"with --head-bits 8 (or {FIX})")
        si: Any = layer.shard_indices  # VocabParallelEmbeddingShardIndices
        rows = (int(si.org_vocab_start_index), int(si.org_vocab_end_index))
        n_rows = sum(output_partition_sizes)  # the rank's rows, padding included
        n = info.in_features
        part = Part(self.name, info, rows, (0, n), 0)
        layer.__dict__["tq_state"] = LayerState(self.name, [part], n, info.bits,
                                                info.group_size, n_rows)
        shapes = {
            # zeros: the padding rows, which no checkpoint row fills, give 0
            "codes": ((n_rows, packed_row_bytes(n, info.bits)), torch.uint8),
            "scales": ((n_rows, -(-n // info.group_size)), torch.float16),
            "codebook": ((1, 2 ** info.bits), torch.float32),
            "outlier_idx": ((0,), torch.int32),  # cut to the rank's rows after loading
            "outlier_val": ((0,), torch.float16),
        }
        if info.col_scale:
            shapes[COL_SCALE] = ((1, n), torch.float16)
        for suffix, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(f"tq_{suffix}", param)
            set_weight_attrs(param, {"weight_loader": functools.partial(_load, layer, suffix)})

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """`ParallelLMHead.tie_weights`: the head reads the embedding's packed weight."""
        other = getattr(embed_tokens, "quant_method", None)
        if not (isinstance(other, TQVocabMethod) and other.role == EMBEDDING
                and other.name == self.name):
            raise UnsupportedError(
                f"tq: {self.name}.weight: the checkpoint stores lm_head as the input "
                f"embedding's weight, but vLLM ties lm_head to a {type(embed_tokens).__name__} "
                f"that tq did not build from it (quant method {type(other).__name__}); {FIX}")
        self._share(layer, embed_tokens)
        layer.__dict__["tq_tied_to"] = embed_tokens
        return layer

    @staticmethod
    def _share(layer: nn.Module, embed_tokens: nn.Module) -> None:
        for pname, param in embed_tokens.named_parameters(recurse=False):
            if pname.startswith("tq_"):
                layer.register_parameter(pname, param)
        layer.__dict__["tq_state"] = layer_state(embed_tokens)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.role == TIED_HEAD:
            embed = layer.__dict__.get("tq_tied_to")
            if embed is None:
                raise UnsupportedError(
                    f"tq: {self.name}.weight: the checkpoint stores lm_head as the input "
                    "embedding's weight (tied), but vLLM built an untied lm_head (is "
                    f"tie_word_embeddings false in config.json?); {FIX}")
            self._share(layer, embed)  # the outliers were replaced below, on the embedding
            return
        st = layer_state(layer)
        part = st.parts[0]
        if ("outlier_idx", 0) not in st.staged or ("outlier_val", 0) not in st.staged:
            raise UnsupportedError(f"tq: {self.name}.weight: outliers missing from the "
                                   "checkpoint")
        idx, val = split.slice_outliers(st.staged["outlier_idx", 0], st.staged["outlier_val", 0],
                                        part.info.in_features, part.rows, part.cols)
        st.staged = {}
        if self.role == EMBEDDING and idx.numel():
            raise UnsupportedError(
                f"tq: {self.name}.weight.outlier_idx: an input embedding tied to lm_head is "
                "looked up from codes and scales alone, this one has exact outliers; "
                f"reconvert with --head-bits 8 (or {FIX})")
        dev = layer.get_parameter("tq_codes").device
        st.outlier_starts = [0, idx.numel()]
        layer.register_parameter("tq_outlier_idx", nn.Parameter(idx.to(dev), requires_grad=False))
        layer.register_parameter("tq_outlier_val", nn.Parameter(val.to(dev), requires_grad=False))
        rid = part.info.rotation
        if rid is not None:
            st.rotation, st.block = rank_rotation(self.config.folder, rid,
                                                  self.config.rotations[rid], part.cols, dev)
        st.key = f"{self.name}#{id(layer)}"
        LAYERS[st.key] = layer

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        st = layer_state(layer)
        if self.role != EMBEDDING:
            raise RuntimeError(f"tq: {self.name}: {self.role} is not an input embedding")
        y: torch.Tensor = torch.ops.vllm.tq_embedding(input_, st.key, st.n_local,
                                                      layer.__dict__["tq_params_dtype"])
        return y

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        st = layer_state(layer)
        y: torch.Tensor = torch.ops.vllm.tq_linear(x, st.key, st.out_features, bias)
        return y


def _load(layer: nn.Module, suffix: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Weight loader of every parameter: keep this rank's rows of the stored tensor."""
    st = layer_state(layer)
    part = st.parts[0]
    if suffix.startswith("outlier"):
        st.staged[suffix, 0] = loaded.detach().to("cpu", copy=True)
        return
    if suffix in ("codebook", COL_SCALE):
        if loaded.shape != param.data[0].shape:
            raise UnsupportedError(f"tq: {part.name}.weight.{suffix}: shape "
                                   f"{tuple(loaded.shape)}, expected {tuple(param.data[0].shape)}")
        param.data[0].copy_(loaded)
        return
    r0, r1 = part.rows
    t = loaded[r0:r1]
    dest = param.data[:r1 - r0]
    if dest.shape != t.shape:
        raise UnsupportedError(f"tq: {part.name}.weight.{suffix}: shape {tuple(t.shape)} on "
                               f"this rank, expected {tuple(dest.shape)}; the checkpoint does "
                               "not match the model config")
    dest.copy_(t)


def _tq_embedding(ids: torch.Tensor, key: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    layer = LAYERS[key]
    st = layer_state(layer)
    signs = st.rotation if isinstance(st.rotation, torch.Tensor) else None  # Hadamard's
    x = embedding_rows(ids, layer.get_parameter("tq_codes"), layer.get_parameter("tq_scales"),
                       layer.get_parameter("tq_codebook")[0], st.bits, st.group_size,
                       st.n_local, signs, st.block)
    return x.to(dtype).reshape(*ids.shape, dim)


def _tq_embedding_fake(ids: torch.Tensor, key: str, dim: int,
                       dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((*ids.shape, dim), dtype=dtype, device=ids.device)


def vocab_method(config: Any, layer: nn.Module, prefix: str, head: bool) -> Any:
    """The method for a VocabParallelEmbedding (head: a ParallelLMHead), or None."""
    tied = {n: i for n, i in config.tensors.items() if i.tied}
    shape = (int(getattr(layer, "org_vocab_size", -1)), int(getattr(layer, "embedding_dim", -1)))
    if head:
        if prefix in config.tensors and not config.tensors[prefix].tied:
            return TQVocabMethod(config, prefix, config.tensors[prefix], HEAD)
        found = [n for n, i in tied.items() if (i.out_features, i.in_features) == shape]
        return TQVocabMethod(config, found[0], tied[found[0]], TIED_HEAD) if found else None
    if prefix in tied:
        return TQVocabMethod(config, prefix, tied[prefix], EMBEDDING)
    if prefix == "" and len(tied) == 1:
        name, info = next(iter(tied.items()))
        if (info.out_features, info.in_features) == shape:
            return TQVocabMethod(config, name, info, EMBEDDING)
    return None


@functools.lru_cache(maxsize=1)
def register_op() -> None:
    """`torch.ops.vllm.tq_embedding`, once per process."""
    direct_register_custom_op("tq_embedding", _tq_embedding, mutates_args=[],
                              fake_impl=_tq_embedding_fake)

"""Synthetic Llama-shaped model folders for benchmarks (random weights, real shapes).

Written tensor by tensor through the checkpoint writer, so making a multi-GB model
never holds more than one tensor in memory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tq_cli.io.safetensors_reader import TORCH_TO_ST
from tq_cli.io.writer import ShardWriter, plan_layout

LLAMA_3_2_1B = {"hidden": 2048, "intermediate": 8192, "layers": 16, "heads": 32,
                "kv_heads": 8, "vocab": 128256}
# Llama-3-8B's and -70B's layer shapes with SmolLM2's vocabulary, so that a folder given
# SmolLM2's tokenizer files (`tokenizer_from`) self-calibrates like a real model.
LLAMA_3_8B_SMOL = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32,
                   "kv_heads": 8, "vocab": 49152}
LLAMA_3_70B_SMOL = {"hidden": 8192, "intermediate": 28672, "layers": 80, "heads": 64,
                    "kv_heads": 8, "vocab": 49152}
# Qwen2.5-0.5B's shapes (its tied 151,936-entry vocabulary, 14 query heads over 2 KV heads
# of 64) as a Llama folder: no q/k/v bias, and SmolLM2's tokenizer, whose ids fit.
QWEN25_05B_SMOL = {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14,
                   "kv_heads": 2, "vocab": 151936}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def llama_shapes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = hidden // heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.up_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    return out


def write_synthetic_llama(folder: Path, *, hidden: int, intermediate: int, layers: int,
                          heads: int, kv_heads: int, vocab: int,
                          dtype: torch.dtype = torch.bfloat16, shards: int = 2,
                          seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A Llama-like folder with `shards` shards of random weights; returns the folder.
    `tokenizer_from`: a model folder whose tokenizer files are copied in (its vocabulary
    must fit `vocab`)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes = llama_shapes(hidden, intermediate, layers, heads, kv_heads, vocab)
    st = TORCH_TO_ST[dtype]
    total = sum(torch.Size(s).numel() for _, s in shapes) * dtype.itemsize
    layout = plan_layout([[(n, st, s)] for n, s in shapes], -(-total // shards))
    # Name shards as transformers does and add the index.
    writer = ShardWriter(folder, layout)
    writer.open(create=True)
    gen = torch.Generator().manual_seed(seed)
    try:
        for name, shape in shapes:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=gen) * shape[1] ** -0.5).to(dtype)
            writer.write(name, t)
    finally:
        writer.close()
    index = {"metadata": {"total_size": total},
             "weight_map": {k: s.shard for k, s in layout.slots.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab,
              "tie_word_embeddings": True, "torch_dtype": str(dtype).removeprefix("torch."),
              "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, folder / name)
    return folder

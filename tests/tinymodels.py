"""Tiny random models built in code (2 layers, awkward widths, several shards).

Used by the tests (through conftest's fixtures) and by scripts/wheel_check.sh, which
imports this file by path from a venv that has tq's wheel and its `models` extra but
no pytest.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["build_tiny_bert", "build_tiny_llama", "save_tiny_tokenizer"]


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


def build_tiny_llama(folder: Path, layers: int = 2, shard: str = "100KB",
                     tied: bool = False, seed: int = 0) -> Path:
    """`tied`: lm_head shares the input embedding's weight (SmolLM2's layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=200,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=tied)
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

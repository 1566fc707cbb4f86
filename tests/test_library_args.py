"""The library's entry points validate their arguments like the CLI does: a bad value is a
tq error of one line naming the argument, never a raw TypeError or RuntimeError from deep
inside torch or transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tq_cli
from tq_cli.errors import TqError


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_bits": "abc"},
     "KV cache settings: bits: Input should be a valid number, unable to parse string as a "
     "number"),
    ({"kv_bits": True}, "KV cache settings: bits: must be a number, got True"),
    ({"kv_bits": 9}, "KV cache settings: bits must be between 1 and 8, got 9.0"),
    ({"kv_bits": 4, "kv_window": -1},
     "KV cache settings: window: Input should be greater than or equal to 0"),
    ({"kv_bits": 4, "kv_window": 2.5}, "KV cache settings: window: Input should be a valid "
     "integer"),
    ({"device": "tpu"}, "device 'tpu' is not one tq runs on; use cpu, cuda (or cuda:N) or auto"),
    ({"device": 3.5}, "device 3.5 is not one tq runs on; use cpu, cuda (or cuda:N) or auto"),
    ({"dtype": torch.int8}, "dtype torch.int8 is not one tq runs models in; use torch.float32, "
     "torch.float16, torch.bfloat16 (or None for the default)"),
    ({"verify_checksums": "no"}, "verify_checksums must be True or False, got 'no'"),
])
def test_load_refuses_bad_arguments_by_name(tmp_path: Path, kwargs: dict,
                                           message: str) -> None:
    # checked before the folder is even looked at
    with pytest.raises(TqError) as e:
        tq_cli.load(tmp_path / "missing", **kwargs)
    assert str(e.value) == message


def test_kv_cache_refuses_bad_bits_by_name() -> None:
    from transformers import LlamaConfig

    with pytest.raises(TqError, match=r"^KV cache settings: bits: Input should be a valid "
                                      "number"):
        tq_cli.kv_cache(LlamaConfig(), bits="four")

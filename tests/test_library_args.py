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
     "tq_cli.load: kv_bits: Input should be a valid number, unable to parse string as a "
     "number"),
    ({"kv_bits": True}, "tq_cli.load: kv_bits: must be a number, got True"),
    ({"kv_bits": 9}, "tq_cli.load: kv_bits: Input should be less than or equal to 8"),
    ({"kv_bits": 4, "kv_window": -1},
     "tq_cli.load: kv_window: Input should be greater than or equal to 0"),
    ({"kv_bits": 4, "kv_window": 2.5}, "tq_cli.load: kv_window: Input should be a valid "
     "integer"),
    ({"device": "tpu"}, "tq_cli.load: device: 'tpu' is not one tq runs on; use cpu, cuda (or "
     "cuda:N) or auto"),
    ({"device": 3.5}, "tq_cli.load: device: 3.5 is not one tq runs on; use cpu, cuda (or "
     "cuda:N) or auto"),
    ({"dtype": torch.int8}, "tq_cli.load: dtype: torch.int8 is not one tq runs models in; use "
     "torch.float32, torch.float16, torch.bfloat16 (or None for the default)"),
    ({"verify_checksums": "no"}, "tq_cli.load: verify_checksums: Input should be a valid "
     "boolean"),
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


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bits": 3.5, "sinks": -1}, "KV cache settings: sinks: Input should be greater than or "
     "equal to 0"),
    ({"bits": 3.5, "colour": 1}, "KV cache settings: colour: Extra inputs are not permitted"),
    ({"code_attention": "yes"}, "KV cache settings: code_attention: must be True, False or "
     "None, got 'yes'"),
    ({"measure_error": 1}, "KV cache settings: measure_error: must be True or False, got 1"),
    ({"spec": {"key_bits": 4}}, "KV cache settings: spec: must be a KVSpec, got dict"),
])
def test_kv_cache_checks_every_argument_before_touching_the_model(kwargs: dict,
                                                                  message: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    with pytest.raises(TqError) as e:
        tq_cli.kv_cache(model, **kwargs)
    assert str(e.value) == message
    assert model.config._attn_implementation == "sdpa"  # still the model's own attention
    with pytest.raises(TqError, match=r"^KV cache settings: model: must be a transformers "
                                      r"model or its config, got str$"):
        tq_cli.kv_cache("llama")


def test_every_spec_takes_a_device_as_load_does() -> None:
    from pydantic import ValidationError

    from tq_cli.conversion.spec import ConvertSpec

    assert ConvertSpec(device="cuda:1").device == "cuda:1"
    for bad in ("tpu", "cuda:x", 3):
        with pytest.raises(ValidationError, match="is not one tq runs on; use cpu, cuda"):
            ConvertSpec(device=bad)


def test_convert_validates_a_spec_given_as_a_dict(small_folder: Path, tmp_path: Path) -> None:
    from tq_cli.conversion.converter import convert

    with pytest.raises(TqError) as e:
        convert(small_folder, tmp_path / "out", {"quant": {"bits": 5}})  # type: ignore[arg-type]
    assert str(e.value) == "tq_cli.convert: spec.quant: bits must be 2, 3, 4 or 8, got 5"
    with pytest.raises(TqError, match=r"^tq_cli\.convert: source and out must be paths"):
        convert(small_folder, 42)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()

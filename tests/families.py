"""Tiny random models of the families people quantize, built in code from transformers'
own config classes (2 layers, awkward widths), saved the way a hub checkpoint is.

Each entry: a builder returning (model, inputs to run it on). The model classes are the
ones `tq_cli.load` picks from config.json's `architectures`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Built = tuple[Any, dict[str, torch.Tensor]]
TEXT = {"vocab_size": 256, "hidden_size": 96, "intermediate_size": 200,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}
VISION = {"hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2,
          "num_attention_heads": 4, "image_size": 32, "patch_size": 8}


def _ids(n: int = 12) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(1))}


def _image_text() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 250, (2, 8), generator=g),
            "pixel_values": torch.randn(2, 3, 32, 32, generator=g)}


def qwen3() -> Built:
    import transformers as T

    return T.Qwen3ForCausalLM(T.Qwen3Config(**TEXT, head_dim=24)), _ids()


def mistral() -> Built:
    import transformers as T

    return T.MistralForCausalLM(T.MistralConfig(**TEXT)), _ids()


def phi3() -> Built:
    import transformers as T

    return T.Phi3ForCausalLM(T.Phi3Config(**TEXT, pad_token_id=0)), _ids()


def gemma3_text() -> Built:
    import transformers as T

    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**TEXT, head_dim=24)), _ids()


def llava() -> Built:
    """With an image: 16 image tokens (32x32 pixels in 8x8 patches, CLS dropped)."""
    import transformers as T

    cfg = T.LlavaConfig(text_config=T.LlamaConfig(**TEXT),
                        vision_config=T.CLIPVisionConfig(**VISION), image_token_index=255)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, 250, (1, 3), generator=g), torch.full((1, 16), 255),
                     torch.randint(0, 250, (1, 5), generator=g)], dim=1)
    pixels = torch.randn(1, 3, 32, 32, generator=g)
    return T.LlavaForConditionalGeneration(cfg), {"input_ids": ids, "pixel_values": pixels}


def gemma3_vlm() -> Built:
    import transformers as T

    cfg = T.Gemma3Config(text_config={**TEXT, "head_dim": 24}, vision_config=VISION,
                         mm_tokens_per_image=4)
    return T.Gemma3ForConditionalGeneration(cfg), _ids()


def idefics3() -> Built:
    import transformers as T

    cfg = T.Idefics3Config(text_config={"model_type": "llama", **TEXT},
                           vision_config={k: v for k, v in VISION.items()}, scale_factor=2)
    return T.Idefics3ForConditionalGeneration(cfg), _ids()


def mistral3() -> Built:
    import transformers as T

    vision = {"model_type": "pixtral", **VISION, "head_dim": 16}
    cfg = T.Mistral3Config(text_config={"model_type": "mistral", **TEXT}, vision_config=vision)
    return T.Mistral3ForConditionalGeneration(cfg), _ids()


def clip() -> Built:
    import transformers as T

    text = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32}
    return T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=VISION,
                                    projection_dim=48)), _image_text()


def siglip() -> Built:
    import transformers as T

    text = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 100,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32}
    return T.SiglipModel(T.SiglipConfig(text_config=text, vision_config=VISION)), _image_text()


def mixtral() -> Built:
    import transformers as T

    cfg = T.MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2)
    return T.MixtralForCausalLM(cfg), _ids()


def qwen2_moe() -> Built:
    import transformers as T

    cfg = T.Qwen2MoeConfig(**TEXT, moe_intermediate_size=72,
                           shared_expert_intermediate_size=120, num_experts=4,
                           num_experts_per_tok=2)
    return T.Qwen2MoeForCausalLM(cfg), _ids()


def qwen2_5_vl() -> Built:
    import transformers as T

    text = {**TEXT, "head_dim": 24,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 4, 6]}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 100, "num_heads": 4,
              "out_hidden_size": 96, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1]}
    cfg = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return T.Qwen2_5_VLForConditionalGeneration(cfg), _ids()


def qwen3_moe() -> Built:
    import transformers as T

    cfg = T.Qwen3MoeConfig(**TEXT, head_dim=24, moe_intermediate_size=72, num_experts=4,
                           num_experts_per_tok=2)
    return T.Qwen3MoeForCausalLM(cfg), _ids()


def olmoe() -> Built:
    import transformers as T

    return T.OlmoeForCausalLM(T.OlmoeConfig(**TEXT, num_experts=4, num_experts_per_tok=2)), _ids()


def deepseek_v3() -> Built:
    """Multi-head latent attention (LoRA-shaped q and kv), a dense first layer, then MoE
    with a shared expert and grouped routing."""
    import transformers as T

    cfg = T.DeepseekV3Config(**{**TEXT, "num_key_value_heads": 4}, moe_intermediate_size=72,
                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                             first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                             n_group=2, topk_group=1)
    return T.DeepseekV3ForCausalLM(cfg), _ids()


def gpt_oss() -> Built:
    import transformers as T

    cfg = T.GptOssConfig(**{**TEXT, "intermediate_size": 96}, head_dim=24,
                         num_local_experts=4, num_experts_per_tok=2,
                         layer_types=["sliding_attention", "full_attention"])
    return T.GptOssForCausalLM(cfg), _ids()


FAMILIES: dict[str, Callable[[], Built]] = {
    "qwen3": qwen3, "mistral": mistral, "phi3": phi3, "gemma3_text": gemma3_text,
    "llava": llava, "gemma3_vlm": gemma3_vlm, "idefics3": idefics3, "mistral3": mistral3,
    "qwen2_5_vl": qwen2_5_vl,
    "clip": clip, "siglip": siglip, "mixtral": mixtral, "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe, "olmoe": olmoe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss,
}

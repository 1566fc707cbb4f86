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


def mamba2() -> Built:
    import transformers as T

    cfg = T.Mamba2Config(vocab_size=256, hidden_size=96, state_size=16, num_hidden_layers=2,
                         expand=2, head_dim=16, num_heads=12, n_groups=1, conv_kernel=4,
                         chunk_size=16, tie_word_embeddings=False)
    return T.Mamba2ForCausalLM(cfg), _ids()


def falcon_h1() -> Built:
    import transformers as T

    cfg = T.FalconH1Config(**TEXT, head_dim=24, mamba_d_ssm=192, mamba_n_heads=12,
                           mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                           mamba_chunk_size=16, mamba_d_conv=4, mamba_expand=2)
    return T.FalconH1ForCausalLM(cfg), _ids()


def granite_hybrid() -> Built:
    """Granite 4.0's hybrid: a Mamba 2 layer, then attention, each with a shared MLP."""
    import transformers as T

    cfg = T.GraniteMoeHybridConfig(**TEXT, layer_types=["mamba", "attention"],
                                   mamba_n_heads=12, mamba_d_head=16, mamba_d_state=16,
                                   mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16,
                                   num_local_experts=0, shared_intermediate_size=200)
    return T.GraniteMoeHybridForCausalLM(cfg), _ids()


def jamba() -> Built:
    """Mamba 1 and attention layers, the second with 4 experts."""
    import transformers as T

    cfg = T.JambaConfig(**TEXT, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)
    return T.JambaForCausalLM(cfg), _ids()


def qwen3_next() -> Built:
    """Gated DeltaNet linear attention, then full attention; MoE with a shared expert."""
    import transformers as T

    cfg = T.Qwen3NextConfig(**TEXT, head_dim=24, moe_intermediate_size=72,
                            shared_expert_intermediate_size=72, num_experts=4,
                            num_experts_per_tok=2, linear_num_value_heads=4,
                            linear_num_key_heads=2, linear_key_head_dim=16,
                            linear_value_head_dim=16,
                            layer_types=["linear_attention", "full_attention"])
    return T.Qwen3NextForCausalLM(cfg), _ids()


def llama4() -> Built:
    """Llama 4's text model: an nn.Linear router with its own forward, and experts stored
    as 3-D parameters of a module transformers does not fuse."""
    import transformers as T

    cfg = T.Llama4TextConfig(**TEXT, head_dim=24, intermediate_size_mlp=200,
                             num_local_experts=4, num_experts_per_tok=1,
                             interleave_moe_layer_step=2, no_rope_layers=[1, 0])
    return T.Llama4ForCausalLM(cfg), _ids()


def t5() -> Built:
    import transformers as T

    cfg = T.T5Config(vocab_size=256, d_model=96, d_kv=24, d_ff=200, num_layers=2, num_heads=4,
                     decoder_start_token_id=0)
    ids = _ids()
    return (T.T5ForConditionalGeneration(cfg),
            {**ids, "decoder_input_ids": ids["input_ids"][:, :5]})


def whisper() -> Built:
    import transformers as T

    cfg = T.WhisperConfig(vocab_size=256, d_model=96, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=200, decoder_ffn_dim=200, num_mel_bins=16,
                          max_source_positions=32, max_target_positions=64,
                          decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)
    g = torch.Generator().manual_seed(1)
    return T.WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(1, 16, 64, generator=g),
        "decoder_input_ids": torch.randint(0, 250, (1, 5), generator=g)}


def modernbert() -> Built:
    import transformers as T

    cfg = T.ModernBertConfig(vocab_size=256, hidden_size=96, intermediate_size=200,
                             num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return T.ModernBertForMaskedLM(cfg), _ids()


def qwen3_vl() -> Built:
    import transformers as T

    text = {**TEXT, "head_dim": 24,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 5, 5],
                             "mrope_interleaved": True}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 100, "num_heads": 4,
              "out_hidden_size": 96, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0]}
    cfg = T.Qwen3VLConfig(text_config=text, vision_config=vision)
    return T.Qwen3VLForConditionalGeneration(cfg), _ids()


def glm4_moe() -> Built:
    import transformers as T

    cfg = T.Glm4MoeConfig(**TEXT, head_dim=24, moe_intermediate_size=72, n_routed_experts=4,
                          num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                          n_group=1, topk_group=1)
    return T.Glm4MoeForCausalLM(cfg), _ids()


FAMILIES: dict[str, Callable[[], Built]] = {
    "qwen3": qwen3, "mistral": mistral, "phi3": phi3, "gemma3_text": gemma3_text,
    "llava": llava, "gemma3_vlm": gemma3_vlm, "idefics3": idefics3, "mistral3": mistral3,
    "qwen2_5_vl": qwen2_5_vl,
    "clip": clip, "siglip": siglip, "mixtral": mixtral, "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe, "olmoe": olmoe, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss,
    # state-space and hybrid models
    "mamba2": mamba2, "falcon_h1": falcon_h1, "granite_hybrid": granite_hybrid, "jamba": jamba,
    "qwen3_next": qwen3_next,
    # encoder-decoders and a newer encoder
    "t5": t5, "whisper": whisper, "modernbert": modernbert,
    # this year's decoders: Llama 4 (its own router and 3-D experts), Qwen3-VL, GLM-4.5's MoE
    "llama4": llama4, "qwen3_vl": qwen3_vl, "glm4_moe": glm4_moe,
}

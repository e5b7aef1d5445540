"""Full-size vision-language presets for planning (`axplug aot`, `axplug train --preset`), built
from the published config.json through the family's architecture (shapes by construction)."""

from __future__ import annotations

from axplug.api.interop import config_json_preset

__all__ = ["llava_15_7b", "gemma3_4b_vision"]

llava_15_7b = config_json_preset(
    "llava-1.5-7b",
    "LLaVA 1.5 7B shapes (CLIP ViT-L/14 at 336 px, its 23 layers the features come from; "
    "Vicuna 7B), for planning",
    {
        "architectures": ["LlavaForConditionalGeneration"],
        "torch_dtype": "float16",
        "image_token_index": 32000,
        "image_seq_length": 576,
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": {
            "model_type": "llama",
            "vocab_size": 32064,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "projection_dim": 768,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_channels": 3,
            "image_size": 336,
            "patch_size": 14,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        },
    },
)

# As published (google/gemma-3-4b-it): sparse, the rest the config classes' defaults.
gemma3_4b_vision = config_json_preset(
    "gemma3-4b-vision",
    "Gemma 3 4B shapes with its SigLIP tower (896 px, 256 tokens per image), for planning",
    {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    },
)

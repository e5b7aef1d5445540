"""Full-size presets for planning (`axplug aot`, `axplug train --preset`), built from the
published config.json of each model through its architecture: the shapes are the checkpoint's
own, by construction, and the layer stack is scanned in bfloat16 like the core's `*-7b`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axplug.api.interop import config_json_preset

__all__ = [
    "mistral_7b",
    "qwen2_7b",
    "qwen3_8b",
    "gemma_7b",
    "olmo2_7b",
    "phi3_mini",
    "gemma3_27b",
]


def _published(architecture: str, **fields: Any) -> dict[str, Any]:
    return {"architectures": [architecture], "torch_dtype": "bfloat16", **fields}


_LLAMA_7B_LIKE: Callable[..., dict] = lambda arch, **kw: _published(  # noqa: E731
    arch, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, **kw,
)  # fmt: skip

mistral_7b = config_json_preset(
    "mistral-7b",
    "Mistral 7B v0.1 shapes (GQA 8, sliding window 4096), for planning",
    _LLAMA_7B_LIKE(
        "MistralForCausalLM",
        vocab_size=32000,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=4096,
        max_position_embeddings=32768,
    ),  # fmt: skip
)
qwen2_7b = config_json_preset(
    "qwen2-7b",
    "Qwen2 7B shapes (GQA 4, q/k/v biases, 152k vocab), for planning",
    _published(
        "Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=28,
    ),  # fmt: skip
)
phi3_mini = config_json_preset(
    "phi3-mini",
    "Phi-3 mini 4k shapes (fused qkv and gate/up tensors), for planning",
    _published(
        "Phi3ForCausalLM",
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        pad_token_id=32000,
    ),  # fmt: skip
)
qwen3_8b = config_json_preset(
    "qwen3-8b",
    "Qwen3 8B shapes (GQA 8, per-head q/k norms, head_dim 128), for planning",
    _published(
        "Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),  # fmt: skip
)
gemma_7b = config_json_preset(
    "gemma-7b",
    "Gemma 7B shapes (GeGLU, head_dim 256, 256k vocab, tied), for planning",
    _published(
        "GemmaForCausalLM",
        vocab_size=256000,
        hidden_size=3072,
        intermediate_size=24576,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh",
    ),  # fmt: skip
)
olmo2_7b = config_json_preset(
    "olmo2-7b",
    "OLMo 2 7B shapes (post-norms, q/k norms over the projections), for planning",
    _published(
        "Olmo2ForCausalLM",
        vocab_size=100352,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=4096,
    ),  # fmt: skip
)
gemma3_27b = config_json_preset(
    "gemma3-27b",
    "Gemma 3 27B text shapes (5 sliding-window layers to 1 global, q/k norms, 262k vocab), "
    "for planning",
    _published(
        "Gemma3ForCausalLM",
        vocab_size=262208,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    ),  # fmt: skip
)

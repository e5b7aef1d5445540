"""MoE presets: tiny trainable ones, and the full-size shapes of published MoE models for
planning (`mixtral-8x7b`: the LLaMA recipe at its sizes; the others built from their
config.json)."""

from __future__ import annotations

from axplug_attention.presets import llama_tiny, sized_llama

from axplug.api.config import Preset
from axplug.api.interop import config_json_preset

__all__ = [
    "moe_tiny",
    "moe_fine_tiny",
    "mixtral_tiny",
    "mixtral_8x7b",
    "qwen3_30b_a3b",
    "deepseek_v3_671b",
]

_ATTENTION, _MOE = "axplug-attention", "axplug-moe"

moe_tiny = Preset(
    "moe-tiny",
    "llama-tiny with 8 experts, top-2 (capacity 1.25) in every layer; trains on CPU",
    llama_tiny.build,
    (*llama_tiny.modifiers, "moe:num_experts=8,top_k=2"),
    {**llama_tiny.providers, "moe": _MOE},
)
moe_fine_tiny = Preset(
    "moe-fine-tiny",
    "llama-tiny with fine-grained experts: 64 of width 176, top-8 drop-free (moe-tiny's "
    "active FLOPs); trains on CPU",
    llama_tiny.build,
    (*llama_tiny.modifiers, "moe:num_experts=64,top_k=8,hidden_dim=176,capacity_factor=None"),
    {**llama_tiny.providers, "moe": _MOE},
)
mixtral_8x7b = Preset(
    "mixtral-8x7b",
    "Mixtral 8x7B shapes (8 experts, top-2, GQA)",
    sized_llama(32000, 4096, 32, 32, 14336),
    ("rope:theta=1000000.0", "gqa:num_kv_heads=8", "moe:num_experts=8,top_k=2"),
    {"rope": _ATTENTION, "gqa": _ATTENTION, "moe": _MOE},
)
mixtral_tiny = Preset(
    "mixtral-tiny",
    "Mixtral recipe at llama-tiny size: 8 experts top-2 drop-free, GQA, rope theta 1e6",
    llama_tiny.build,
    (
        "rope:theta=1000000.0",
        "gqa:num_kv_heads=2",
        "moe:num_experts=8,top_k=2,capacity_factor=None",
    ),
    {"rope": _ATTENTION, "gqa": _ATTENTION, "moe": _MOE},
)


def _published(architecture: str, **fields: object) -> dict:
    return {"architectures": [architecture], "torch_dtype": "bfloat16", **fields}


qwen3_30b_a3b = config_json_preset(
    "qwen3-30b-a3b",
    "Qwen3 30B-A3B shapes (128 experts top-8, 3.3B active, q/k norms), for planning",
    _published(
        "Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
)
deepseek_v3_671b = config_json_preset(
    "deepseek-v3-671b",
    "DeepSeek-V3 shapes (MLA, 256 experts top-8 + 1 shared, 3 dense layers first), for planning",
    _published(
        "DeepseekV3ForCausalLM",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=163840,
        tie_word_embeddings=False,
    ),
)

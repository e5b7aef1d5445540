"""Tiny trainable MoE presets (the full-size `mixtral-8x7b` shapes are a core preset)."""

from __future__ import annotations

from axplug.presets import Preset, resolve_preset

__all__ = ["moe_tiny", "mixtral_tiny"]

_ATTENTION, _MOE = "axplug-attention", "axplug-moe"
llama_tiny = resolve_preset("llama-tiny")  # the core preset these build on

moe_tiny = Preset(
    "moe-tiny",
    "llama-tiny with 8 experts, top-2 (capacity 1.25) in every layer; trains on CPU",
    llama_tiny.build,
    (*llama_tiny.modifiers, "moe:num_experts=8,top_k=2"),
    {**llama_tiny.providers, "moe": _MOE},
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

"""Families that are the LLaMA layout with other defaults or one more option: each is a
contribution of a few lines and no new layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import Llama, llama_base

from axplug.api import HFFields

__all__ = ["Mistral", "Qwen2"]


class Mistral(Llama):
    """MistralForCausalLM: LLaMA with a sliding window (`sliding_window`, null: none)."""

    architecture = "MistralForCausalLM"
    model_type = "mistral"
    defaults: Mapping[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    aliases: Mapping[str, str] = {}
    implied: Mapping[str, Any] = {"attention_bias": False, "qkv_bias": False, "mlp_bias": False}

    def base_config(self, fields: HFFields) -> Any:
        return llama_base(fields)


class Qwen2(Mistral):
    """Qwen2ForCausalLM: LLaMA with q/k/v biases (no output bias)."""

    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    defaults: Mapping[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    implied: Mapping[str, Any] = {"attention_bias": False, "qkv_bias": True, "mlp_bias": False}

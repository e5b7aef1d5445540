"""Families with q/k RMSNorm and their own norm placement: Qwen3 (per-head q/k norms), OLMo 2
(q/k norms over the whole projections, norms after each branch instead of before)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import llama_base

from axplug.api import HFFields, HFTensor
from axplug.api.interop import attention_tensors, decoder_tensors, mlp_tensors, norm_tensors

__all__ = ["Qwen3", "Olmo2"]


def _qk_norms(base: Any, over: str) -> Any:
    from axplug.api.layers import RMSNorm

    attention = base.model.decoder.transformer.layer.attention
    attention.qk_norm = RMSNorm.default_config()
    attention.qk_norm_over = over
    return base


def _qk_norm_tensors(param: str, hf: str, attention: Any) -> dict[str, HFTensor]:
    return {
        **norm_tensors(f"{param}.q_norm", f"{hf}.q_norm", attention.qk_norm),
        **norm_tensors(f"{param}.k_norm", f"{hf}.k_norm", attention.qk_norm),
    }


class Qwen3:
    """Qwen3ForCausalLM: LLaMA with an RMSNorm over each q and k head before RoPE."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    defaults: Mapping[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    aliases: Mapping[str, str] = {"qkv_bias": "attention_bias"}
    implied: Mapping[str, Any] = {"mlp_bias": False}

    def base_config(self, fields: HFFields) -> Any:
        return _qk_norms(llama_base(fields), "head_dim")

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            attn = f"{hf}.self_attn"
            return {
                **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
                **attention_tensors(f"{param}.attention", attn, cfg.attention),
                **_qk_norm_tensors(f"{param}.attention", attn, cfg.attention),
                **norm_tensors(
                    f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", cfg.norm
                ),
                **mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", cfg.feed_forward),
            }

        return decoder_tensors(model, layer)


class Olmo2:
    """Olmo2ForCausalLM: x + norm(f(x)) per branch (no pre-norms), q/k RMSNorm over the whole
    q and k projections."""

    architecture = "Olmo2ForCausalLM"
    model_type = "olmo2"
    defaults: Mapping[str, Any] = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    aliases: Mapping[str, str] = {"qkv_bias": "attention_bias"}
    implied: Mapping[str, Any] = {"mlp_bias": False}

    def base_config(self, fields: HFFields) -> Any:
        cfg = _qk_norms(llama_base(fields), "projection")
        cfg.model.decoder.transformer.layer.set(pre_norm=False, post_norm=True)
        return cfg

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            attn = f"{hf}.self_attn"
            return {
                **attention_tensors(f"{param}.attention", attn, cfg.attention),
                **_qk_norm_tensors(f"{param}.attention", attn, cfg.attention),
                **norm_tensors(
                    f"{param}.post_attention_norm", f"{hf}.post_attention_layernorm", cfg.norm
                ),
                **mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", cfg.feed_forward),
                **norm_tensors(
                    f"{param}.post_feed_forward_norm", f"{hf}.post_feedforward_layernorm", cfg.norm
                ),
            }

        return decoder_tensors(model, layer)

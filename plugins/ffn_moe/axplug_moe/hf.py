"""The Hugging Face Mixtral architecture (`axplug.architectures`: MixtralForCausalLM): the
LLaMA layout with a `MoEFeedForward` in every layer (the core knows no MoE tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.interop import (
    attention_tensors,
    decoder_tensors,
    linear_tensors,
    llama_base,
    norm_tensors,
)

__all__ = ["Mixtral", "mixtral_expert_tensors"]


def mixtral_expert_tensors(param: str, hf: str, moe: Any) -> dict[str, HFTensor]:
    """`block_sparse_moe` <-> a `MoEFeedForward`: expert j is w2(silu(w1 x) * w3 x), each an
    [out, in] Linear; axplug stacks the experts on a leading axis, [in, out] each."""
    e = moe.num_experts
    out = linear_tensors(f"{param}.router", f"{hf}.gate", moe.router)
    for ours, theirs in (("wi_gate", "w1"), ("wi_up", "w3"), ("wo", "w2")):
        out[f"{param}.{ours}"] = HFTensor(f"{hf}.experts.{{e}}.{theirs}.weight", True, experts=e)
    return out


class Mixtral:
    """MixtralForCausalLM: softmax top-k routing renormalized, no drops, no shared experts."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    defaults: Mapping[str, Any] = {
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    }
    aliases: Mapping[str, str] = {
        "moe_intermediate_size": "intermediate_size",
        "qkv_bias": "attention_bias",
    }

    def base_config(self, fields: HFFields) -> Any:
        from axplug.presets import resolve_preset

        experts = fields.raw.get("num_local_experts", self.defaults["num_local_experts"])
        return llama_base(
            fields,
            self.architecture,
            preset=resolve_preset("mixtral-8x7b"),
            modifiers=[f"moe:num_experts={experts}"],
        )

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            return {
                **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
                **attention_tensors(f"{param}.attention", f"{hf}.self_attn", cfg.attention),
                **norm_tensors(
                    f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", cfg.norm
                ),
                **mixtral_expert_tensors(
                    f"{param}.feed_forward", f"{hf}.block_sparse_moe", cfg.feed_forward
                ),
            }

        return decoder_tensors(model, layer)

"""Phi-3: the LLaMA layout with fused tensors (`qkv_proj`, `gate_up_proj`) and partial RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import llama_base

from axplug.api import HFFields, HFTensor
from axplug.api.interop import decoder_tensors, linear_tensors, norm_tensors

__all__ = ["Phi3"]


def _rows(param: str, hf: str, start: int, stop: int) -> dict[str, HFTensor]:
    """Rows start:stop of a fused [out, in] weight as one axplug [in, out] weight."""
    return {f"{param}.weight": HFTensor(f"{hf}.weight", transpose=True, part=(0, start, stop))}


class Phi3:
    """Phi3ForCausalLM (4k context: default RoPE; longrope scaling is refused by the RoPE)."""

    architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    defaults: Mapping[str, Any] = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    aliases: Mapping[str, str] = {}
    implied: Mapping[str, Any] = {"attention_bias": False, "qkv_bias": False, "mlp_bias": False}

    def base_config(self, fields: HFFields) -> Any:
        for dropout in ("resid_pdrop", "embd_pdrop"):
            fields.expect(dropout, 0.0, 0, why="dropout is not imported")
        fields.get("original_max_position_embeddings", None)  # read by longrope only
        return llama_base(fields)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            attention = cfg.attention
            heads = attention.num_heads
            kv_heads = getattr(attention.qkv, "num_kv_heads", heads)
            q, kv = heads * attention.head_dim, kv_heads * attention.head_dim
            fused, qkv = f"{hf}.self_attn.qkv_proj", f"{param}.attention.qkv"
            hidden, mlp = cfg.feed_forward.hidden_dim, f"{param}.feed_forward"
            return {
                **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
                **_rows(f"{qkv}.q", fused, 0, q),
                **_rows(f"{qkv}.k", fused, q, q + kv),
                **_rows(f"{qkv}.v", fused, q + kv, q + 2 * kv),
                **linear_tensors(f"{param}.attention.output", f"{hf}.self_attn.o_proj", None),
                **norm_tensors(
                    f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", cfg.norm
                ),
                **_rows(f"{mlp}.wi_gate", f"{hf}.mlp.gate_up_proj", 0, hidden),
                **_rows(f"{mlp}.wi_up", f"{hf}.mlp.gate_up_proj", hidden, 2 * hidden),
                **linear_tensors(f"{mlp}.wo", f"{hf}.mlp.down_proj", None),
            }

        return decoder_tensors(model, layer)

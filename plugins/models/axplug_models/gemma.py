"""Gemma (1): the LLaMA layout with GeGLU (tanh GELU), (1 + w) RMSNorms, embeddings scaled by
sqrt(hidden_size) and tied embeddings by default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.interop import decoder_tensors, llama_base

__all__ = ["Gemma", "gemma_base"]


def gemma_base(fields: HFFields, architecture: str) -> Any:
    """The LLaMA layout with Gemma's norms, embedding scale and GeGLU."""
    from axplug.config import visit
    from axplug.layers import RMSNorm

    if fields.raw.get("hidden_activation") is not None:  # older checkpoints: it wins, as in HF
        fields.raw["hidden_act"] = fields.get("hidden_activation")
    fields.expect("use_bidirectional_attention", None, False, why="a causal LM's is causal")
    cfg = llama_base(fields, architecture)
    cfg.model.decoder.embedding_scale = float(fields.raw.get("hidden_size", 0)) ** 0.5

    def offset(_path: str, value: Any) -> None:
        if getattr(value, "klass", None) is RMSNorm:
            value.scale_offset = 1.0

    visit(cfg.model, offset)
    return cfg


class Gemma:
    """GemmaForCausalLM."""

    architecture = "GemmaForCausalLM"
    model_type = "gemma"
    defaults: Mapping[str, Any] = {
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
    }
    aliases: Mapping[str, str] = {"qkv_bias": "attention_bias"}
    implied: Mapping[str, Any] = {"mlp_bias": False}

    def base_config(self, fields: HFFields) -> Any:
        return gemma_base(fields, self.architecture)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        return decoder_tensors(model)

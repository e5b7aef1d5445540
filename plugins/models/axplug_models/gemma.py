"""Gemma (1): the LLaMA layout with GeGLU (tanh GELU), (1 + w) RMSNorms, embeddings scaled by
sqrt(hidden_size) and tied embeddings by default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import llama_base

from axplug.api import HFFields, HFTensor
from axplug.api.interop import decoder_tensors

__all__ = ["Gemma", "gemma_base"]


def gemma_base(fields: HFFields) -> Any:
    """The LLaMA layout with Gemma's norms, embedding scale and GeGLU."""
    from axplug.api.config import visit
    from axplug.api.layers import RMSNorm

    if fields.raw.get("hidden_activation") is not None:  # older checkpoints: it wins, as in HF
        fields.raw["hidden_act"] = fields.get("hidden_activation")
    fields.expect("use_bidirectional_attention", None, False, why="a causal LM's is causal")
    cfg = llama_base(fields)
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
        return gemma_base(fields)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        return decoder_tensors(model)


def _patterned(cfg: Any) -> Any:
    """The stack as a `PatternedTransformer`: its layers differ by `layer_types`."""
    from axplug.api.config import replace_config
    from axplug.api.layers import StackedTransformer
    from axplug_models.pattern import PatternedTransformer

    return replace_config(
        cfg,
        target=StackedTransformer,
        new_cfg=PatternedTransformer.default_config(),
        carry=["layer"],
    )


def _gemma2_like(fields: HFFields, *, qk_norm: bool) -> Any:
    """Gemma 2 / 3: Gemma with a norm before and after each branch, a query scale of
    query_pre_attn_scalar ** -0.5, optional soft-caps, and sliding/full layers."""
    from axplug.api.layers import RMSNorm

    cfg = gemma_base(fields)
    layer = cfg.model.decoder.transformer.layer
    if qk_norm:
        layer.attention.qk_norm = RMSNorm.default_config().set(scale_offset=1.0)
        layer.attention.qk_norm_over = "head_dim"
    layer.set(pre_norm=True, post_norm=True)
    layer.attention.logit_softcap = fields.get("attn_logit_softcapping", None)
    layer.attention.kernel.scale = fields.number("query_pre_attn_scalar") ** -0.5
    cfg.model.decoder.final_logit_softcap = fields.get("final_logit_softcapping", None)
    return _patterned(cfg)


def _gemma2_tensors(model: Any) -> dict[str, HFTensor]:
    from axplug.api.interop import attention_tensors, mlp_tensors, norm_tensors

    def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
        attention, attn = cfg.attention, f"{hf}.self_attn"
        out = {
            **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
            **attention_tensors(f"{param}.attention", attn, attention),
            **norm_tensors(
                f"{param}.post_attention_norm", f"{hf}.post_attention_layernorm", cfg.norm
            ),
            **norm_tensors(
                f"{param}.feed_forward_norm", f"{hf}.pre_feedforward_layernorm", cfg.norm
            ),
            **mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", cfg.feed_forward),
            **norm_tensors(
                f"{param}.post_feed_forward_norm", f"{hf}.post_feedforward_layernorm", cfg.norm
            ),
        }
        if attention.qk_norm is not None:
            out.update(
                norm_tensors(f"{param}.attention.q_norm", f"{attn}.q_norm", attention.qk_norm)
            )
            out.update(
                norm_tensors(f"{param}.attention.k_norm", f"{attn}.k_norm", attention.qk_norm)
            )
        return out

    return decoder_tensors(model, layer)


def _gemma2_fields(model: Any) -> dict:
    attention = model.decoder.transformer.layer.attention
    scale = attention.kernel.scale  # None: 1/sqrt(head_dim), not Gemma's
    return {
        "attn_logit_softcapping": attention.logit_softcap,
        "final_logit_softcapping": model.decoder.final_logit_softcap,
        "query_pre_attn_scalar": None if scale is None else round(scale**-2),
    }


class Gemma2(Gemma):
    """Gemma2ForCausalLM: pre- and post-norms, soft-capped attention scores and logits,
    alternating sliding-window and full layers."""

    architecture = "Gemma2ForCausalLM"
    model_type = "gemma2"
    defaults: Mapping[str, Any] = {**Gemma.defaults, "sliding_window_pattern": 2}

    def base_config(self, fields: HFFields) -> Any:
        return _gemma2_like(fields, qk_norm=False)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        return _gemma2_tensors(model)

    def config_fields(self, model: Any) -> dict:
        return _gemma2_fields(model)


class Gemma3(Gemma2):
    """Gemma3ForCausalLM (text): Gemma 2 with per-head (1 + w) q/k norms, no soft-caps by
    default, five sliding layers to one full, each kind with its own RoPE."""

    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    # Gemma3TextConfig's: published configs (a vision-language model's text_config) are sparse.
    defaults: Mapping[str, Any] = {
        **Gemma.defaults,
        "sliding_window_pattern": 6,
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    }

    def base_config(self, fields: HFFields) -> Any:
        return _gemma2_like(fields, qk_norm=True)

"""The LLaMA family (`axplug.architectures`: LlamaForCausalLM) and `llama_base`, the LLaMA
recipe other families build on: the core's layers with this plugin's RoPE and GQA.

The tensor layout (`decoder_tensors` and its parts) is the core's (`axplug.interop`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.api.interop import decoder_tensors

__all__ = ["Llama", "llama_base"]


def llama_base(fields: HFFields, *, preset: Any = None, modifiers: Sequence[str] = ()) -> Any:
    """A LLaMA-layout trainer config (a stock preset's recipe, unrolled stack, RoPE, GQA where
    config.json has fewer k/v heads) for the layers' `hf_read` to fill; then `modifiers`."""
    from axplug.api.config import make_modifier, replace_config
    from axplug.api.layers import RepeatedTransformer, StackedTransformer
    from axplug_attention.gqa import GroupedQKVLinear
    from axplug_attention.presets import llama2_7b
    from axplug_attention.rope import RotaryPositionTransform

    cfg = (preset or llama2_7b).build()
    cfg = replace_config(
        cfg,
        target=RepeatedTransformer,
        new_cfg=StackedTransformer.default_config(),
        carry=["layer", "num_layers"],
        missing_ok=True,
    )
    attention = cfg.model.decoder.transformer.layer.attention
    attention.position = RotaryPositionTransform.default_config()
    heads = fields.get("num_attention_heads", None)  # the family's default where absent
    kv_heads = fields.get("num_key_value_heads", None)
    if kv_heads is not None and kv_heads != heads:
        attention.qkv = GroupedQKVLinear.default_config().set(linear=attention.qkv.linear)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg


class Llama:
    """LlamaForCausalLM: RMSNorm, SwiGLU, RoPE with or without Llama 3 scaling, GQA, tied or not."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    defaults: Mapping[str, Any] = {"rms_norm_eps": 1e-6}
    aliases: Mapping[str, str] = {"qkv_bias": "attention_bias"}  # one flag for all four

    def base_config(self, fields: HFFields) -> Any:
        fields.expect("pretraining_tp", 1, why="a split of the projections for training only")
        return llama_base(fields)

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        return decoder_tensors(model)

"""The LLaMA tensor layout Hugging Face families share (`decoder_tensors` and its parts); the
families themselves, LLaMA's too, are plugins (`axplug.architectures`).

LLaMA-layout checkpoints name tensors `model.embed_tokens`, `model.layers.{i}.self_attn.
{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`,
`model.norm` and `lm_head`, each Linear [out, in]. Their q/k rows are already laid out for
`rotate_half` RoPE (pairs (i, i + head_dim/2)): axplug's non-interleaved RoPE, no permutation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axplug.api._hf import HFTensor

__all__ = [
    "decoder_tensors",
    "linear_tensors",
    "norm_tensors",
    "attention_tensors",
    "mlp_tensors",
]

LayerTensors = Callable[[int, Any, str, str], dict[str, HFTensor]]


def linear_tensors(param: str, hf: str, linear: Any) -> dict[str, HFTensor]:
    """A Linear's weight (transposed) and bias, if it has one (`linear`: its config, or
    whether it has a bias)."""
    out = {f"{param}.weight": HFTensor(f"{hf}.weight", transpose=True)}
    if linear is True or getattr(linear, "bias", False):
        out[f"{param}.bias"] = HFTensor(f"{hf}.bias")
    return out


def norm_tensors(param: str, hf: str, norm: Any) -> dict[str, HFTensor]:
    """A norm's scale (`weight`) and, for a LayerNorm with one, its bias."""
    out = {f"{param}.scale": HFTensor(f"{hf}.weight")}
    if getattr(norm, "bias", False) is True:
        out[f"{param}.bias"] = HFTensor(f"{hf}.bias")
    return out


def attention_tensors(param: str, hf: str, attention: Any) -> dict[str, HFTensor]:
    """q/k/v/o projections named `{hf}.{q,k,v,o}_proj`."""
    out: dict[str, HFTensor] = {}
    qkv = attention.qkv
    bias = bool(getattr(qkv, "bias", False) or qkv.linear.bias)
    for name in "qkv":
        out.update(linear_tensors(f"{param}.qkv.{name}", f"{hf}.{name}_proj", bias))
    out.update(linear_tensors(f"{param}.output", f"{hf}.o_proj", attention.output))
    return out


def mlp_tensors(param: str, hf: str, ffn: Any) -> dict[str, HFTensor]:
    """A gated MLP named `{hf}.{gate,up,down}_proj`."""
    out: dict[str, HFTensor] = {}
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out.update(
            linear_tensors(f"{param}.{ours}", f"{hf}.{theirs}", getattr(ffn, "linear", None))
        )
    return out


def llama_layer_tensors(i: int, layer: Any, param: str, hf: str) -> dict[str, HFTensor]:
    """One LLaMA-layout decoder layer."""
    return {
        **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", layer.norm),
        **attention_tensors(f"{param}.attention", f"{hf}.self_attn", layer.attention),
        **norm_tensors(f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", layer.norm),
        **mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", layer.feed_forward),
    }


def decoder_tensors(
    model: Any, layer_tensors: LayerTensors = llama_layer_tensors, *, prefix: str = "model"
) -> dict[str, HFTensor]:
    """Embedding, every layer (`layer_tensors(i, layer config, param path, HF prefix)`; the
    path from the stack's `hf_layer_path(cfg, i)` where it has one), the final norm and the
    head (absent when tied), in the LLaMA layout."""
    decoder = model.decoder
    out = {"decoder.embedding.weight": HFTensor(f"{prefix}.embed_tokens.weight")}
    out.update(norm_tensors("decoder.output_norm", f"{prefix}.norm", decoder.output_norm))
    if not decoder.tie_word_embeddings:
        out.update(linear_tensors("decoder.lm_head", "lm_head", decoder.lm_head))
    stack = decoder.transformer
    # Where layer i's parameters sit below the stack (a scanned patterned stack's step and
    # slot); `layer{i}` also names a scanned stack's slice i.
    for i in range(stack.num_layers):
        param = f"decoder.transformer.{stack.klass.hf_layer_path(stack, i)}"
        out.update(layer_tensors(i, stack.layer, param, f"{prefix}.layers.{i}"))
    return out

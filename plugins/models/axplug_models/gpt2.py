"""GPT-2: learned absolute positions, LayerNorms, a GELU MLP, biases everywhere, and
`Conv1D` tensors ([in, out], no transpose) with q/k/v fused in `c_attn`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug.api import HFFields, HFTensor
from axplug.api.interop import norm_tensors

__all__ = ["GPT2"]

# GPT-2's names of the fields the layers read (its config class's attribute_map).
_ALIASES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "n_inner",
    "layer_norm_eps": "layer_norm_epsilon",
    "hidden_act": "activation_function",
    "max_position_embeddings": "n_positions",
}


def _conv1d(param: str, hf: str, part: tuple[int, int] | None = None) -> dict[str, HFTensor]:
    """A Conv1D's weight [in, out] and bias [out], or the columns `part` of a fused one."""
    if part is None:
        return {
            f"{param}.weight": HFTensor(f"{hf}.weight"),
            f"{param}.bias": HFTensor(f"{hf}.bias"),
        }
    start, stop = part
    return {
        f"{param}.weight": HFTensor(f"{hf}.weight", part=(1, start, stop)),
        f"{param}.bias": HFTensor(f"{hf}.bias", part=(0, start, stop)),
    }


class GPT2:
    """GPT2LMHeadModel (tied head). Dropout rates (`*_pdrop`) are training settings and are
    read but not imported: the imported model has none."""

    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"
    defaults: Mapping[str, Any] = {
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "n_positions": 1024,
    }
    aliases: Mapping[str, str] = _ALIASES
    implied: Mapping[str, Any] = {
        "qkv_bias": True, "attention_bias": True, "mlp_bias": True, "head_dim": None,
        "num_key_value_heads": None, "attention_dropout": 0.0, "sliding_window": None,
    }  # fmt: skip

    def base_config(self, fields: HFFields) -> Any:
        from axplug_attention.llama import llama_base

        from axplug.api.layers import Embedding, IdentityPositionTransform, LayerNorm

        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"):
            fields.get(name, None)  # training-only
        for name in ("summary_type", "summary_use_proj", "summary_activation",
                     "summary_proj_to_labels", "n_ctx"):  # fmt: skip
            fields.get(name, None)  # the double-heads model's, or unused
        fields.expect("scale_attn_weights", True, why="GPT-2 scales by 1/sqrt(head_dim)")
        for name in (
            "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",
            "add_cross_attention",
        ):
            fields.expect(name, False)
        if fields.raw.get("n_inner") is None:  # 4 * n_embd, as GPT-2 computes it
            fields.raw["n_inner"] = 4 * int(fields.raw.get("n_embd", 768))
        cfg = llama_base(fields)
        decoder = cfg.model.decoder
        decoder.position_embedding = Embedding.default_config()
        decoder.max_positions = fields.positive_int("n_positions")
        decoder.output_norm = LayerNorm.default_config()
        layer = decoder.transformer.layer
        layer.norm = LayerNorm.default_config()
        layer.attention.position = IdentityPositionTransform.default_config()
        layer.feed_forward.gated = False
        return cfg

    def config_fields(self, model: Any) -> dict:
        return {"n_positions": model.decoder.max_positions}

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        decoder = model.decoder
        d = decoder.dim
        out = {
            "decoder.embedding.weight": HFTensor("transformer.wte.weight"),
            "decoder.position_embedding.weight": HFTensor("transformer.wpe.weight"),
            **norm_tensors("decoder.output_norm", "transformer.ln_f", decoder.output_norm),
        }
        layer = decoder.transformer.layer
        for i in range(decoder.transformer.num_layers):
            p, hf = f"decoder.transformer.layer{i}", f"transformer.h.{i}"
            qkv = f"{p}.attention.qkv"
            out.update(
                {
                    **norm_tensors(f"{p}.attention_norm", f"{hf}.ln_1", layer.norm),
                    **_conv1d(f"{qkv}.q", f"{hf}.attn.c_attn", (0, d)),
                    **_conv1d(f"{qkv}.k", f"{hf}.attn.c_attn", (d, 2 * d)),
                    **_conv1d(f"{qkv}.v", f"{hf}.attn.c_attn", (2 * d, 3 * d)),
                    **_conv1d(f"{p}.attention.output", f"{hf}.attn.c_proj"),
                    **norm_tensors(f"{p}.feed_forward_norm", f"{hf}.ln_2", layer.norm),
                    **_conv1d(f"{p}.feed_forward.wi_up", f"{hf}.mlp.c_fc"),
                    **_conv1d(f"{p}.feed_forward.wo", f"{hf}.mlp.c_proj"),
                }
            )
        return out

"""DeepSeek-V3 (`axplug.architectures`: DeepseekV3ForCausalLM): multi-head latent attention
(axplug-attention's `mla`), dense layers first, then MoE layers of sigmoid group-limited
routing with shared experts; experts and router named as Qwen-MoE's (`mlp.experts.{e}.*`,
`mlp.gate` with its `e_score_correction_bias`), shared experts `mlp.shared_experts.*`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import llama_base
from axplug_attention.mla import MultiHeadLatentAttention

from axplug.api import HFFields, HFTensor
from axplug.api.interop import decoder_tensors, mlp_tensors, norm_tensors

__all__ = ["DeepseekV3", "mla_tensors", "deepseek_moe_tensors"]


def mla_tensors(param: str, hf: str, mla: Any) -> dict[str, HFTensor]:
    """`self_attn` of DeepSeek-V3 <-> a `MultiHeadLatentAttention` (each Linear [out, in])."""

    def linear(ours: str, theirs: str, bias: bool = False) -> dict[str, HFTensor]:
        out = {f"{param}.{ours}.weight": HFTensor(f"{hf}.{theirs}.weight", transpose=True)}
        if bias:
            out[f"{param}.{ours}.bias"] = HFTensor(f"{hf}.{theirs}.bias")
        return out

    if mla.q_lora_rank is None:
        out = linear("q_proj", "q_proj")
    else:
        out = {
            **linear("q_a_proj", "q_a_proj", mla.bias),
            f"{param}.q_a_norm.scale": HFTensor(f"{hf}.q_a_layernorm.weight"),
            **linear("q_b_proj", "q_b_proj"),
        }
    return {
        **out,
        **linear("kv_a_proj", "kv_a_proj_with_mqa", mla.bias),
        f"{param}.kv_a_norm.scale": HFTensor(f"{hf}.kv_a_layernorm.weight"),
        **linear("kv_b_proj", "kv_b_proj"),
        **linear("output", "o_proj", mla.bias),
    }


def deepseek_moe_tensors(param: str, hf: str, moe: Any) -> dict[str, HFTensor]:
    """`mlp` of a DeepSeek-V3 MoE layer <-> a `MoEFeedForward` with a `DeepSeekRouter`:
    `gate` (the router and its correction bias), `experts.{e}` and `shared_experts`."""
    e = moe.num_experts
    out = {
        f"{param}.router.weight": HFTensor(f"{hf}.gate.weight", transpose=True),
        f"{param}.router.e_score_correction_bias": HFTensor(f"{hf}.gate.e_score_correction_bias"),
    }
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        out[f"{param}.{ours}"] = HFTensor(f"{hf}.experts.{{e}}.{theirs}.weight", True, experts=e)
    if moe.num_shared_experts:
        out.update(mlp_tensors(f"{param}.shared_expert", f"{hf}.shared_experts", None))
    return out


class DeepseekV3:
    """DeepseekV3ForCausalLM: MLA in every layer; `first_k_dense_replace` dense SwiGLU layers
    (intermediate_size), then MoE layers: sigmoid scores, `e_score_correction_bias` for the
    choice only, top-k within the `topk_group` best of `n_group` expert groups, gates
    renormalized (`norm_topk_prob`) times `routed_scaling_factor`, plus `n_shared_experts`
    experts every token runs. YaRN RoPE scaling is not supported (refused by name)."""

    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    # transformers' DeepseekV3Config values of fields a config.json may omit. Not
    # q_lora_rank: its null (no q compression) must not read as the default 1536.
    defaults: Mapping[str, Any] = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
        "rope_interleave": True,
    }
    aliases: Mapping[str, str] = {"num_local_experts": "n_routed_experts"}
    # Fixed in DeepSeek-V3's code: no MLP biases; shared experts are n_shared_experts
    # ungated experts (not Qwen2-MoE's one gated expert of its own width).
    implied: Mapping[str, Any] = {
        "mlp_bias": False,
        "shared_expert_intermediate_size": None,
        "shared_expert_gate": False,
    }

    def base_config(self, fields: HFFields) -> Any:
        from axplug_moe.group import DenseFirstStack
        from axplug_moe.layer import MoEFeedForward
        from axplug_moe.router import DeepSeekRouter

        fields.expect("pretraining_tp", 1, why="a split of the projections for training only")
        # Multi-token-prediction modules: transformers' DeepseekV3ForCausalLM builds none;
        # their weights (model.layers.{num_hidden_layers}.*) are read with `--modifier mtp`
        # (axplug-mtp), else left alone (`ignored_tensors`).
        mtp = fields.get("num_nextn_predict_layers", 0)
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            fields.problem(f"num_nextn_predict_layers={mtp!r} (expected an integer >= 0)")
        if fields.raw.get("n_shared_experts") == 0:
            fields.problem("n_shared_experts=0 (transformers builds a zero-width shared MLP)")
        cfg = llama_base(fields)
        stack = cfg.model.decoder.transformer
        layer = stack.layer
        layer.attention = MultiHeadLatentAttention.default_config().set(
            position=layer.attention.position
        )
        dense = copy.deepcopy(layer)
        layer.feed_forward = MoEFeedForward.default_config().set(
            router=DeepSeekRouter.default_config()
        )
        cfg.model.decoder.transformer = DenseFirstStack.default_config().set(
            layer=layer, dense_layer=dense, num_layers=stack.num_layers
        )
        return cfg

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        stack = model.decoder.transformer

        def layer(i: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            cfg = stack.dense_layer if i < stack.num_dense_layers else stack.layer
            return _layer_tensors(cfg, param, hf)

        out = decoder_tensors(model, layer)
        # Multi-token-prediction modules (axplug-mtp's `mtp` modifier): checkpoint layers
        # num_hidden_layers + k, each a decoder layer with its norms and projection.
        for k in range(getattr(model, "depth", 0) if hasattr(model, "module") else 0):
            hf, param, module = f"model.layers.{stack.num_layers + k}", f"mtp{k}", model.module
            out.update(_layer_tensors(module.block, f"{param}.block", hf))
            out.update(norm_tensors(f"{param}.enorm", f"{hf}.enorm", module.norm))
            out.update(norm_tensors(f"{param}.hnorm", f"{hf}.hnorm", module.norm))
            out.update(norm_tensors(f"{param}.post_norm", f"{hf}.shared_head.norm", module.norm))
            out[f"{param}.eh_proj.weight"] = HFTensor(f"{hf}.eh_proj.weight", transpose=True)
        return out

    def ignored_tensors(self, model: Any) -> tuple[str, ...]:
        # The checkpoint's multi-token-prediction layers (model.layers.{num_hidden_layers}.*
        # on): the ones the model has not got, and the copies of the embedding and head each
        # one carries. Published checkpoints have one; a few more are covered.
        first = model.decoder.transformer.num_layers
        depth = getattr(model, "depth", 0) if hasattr(model, "module") else 0
        copies = [
            f"model.layers.{first + k}.{name}."
            for k in range(depth)
            for name in ("embed_tokens", "shared_head.head")
        ]
        return (*copies, *(f"model.layers.{i}." for i in range(first + depth, first + 8)))


def _layer_tensors(cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
    """A DeepSeek-V3 decoder layer's tensors (MLA; a dense MLP or the MoE block)."""
    ffn = cfg.feed_forward
    moe = hasattr(ffn, "router")
    return {
        **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
        **mla_tensors(f"{param}.attention", f"{hf}.self_attn", cfg.attention),
        **norm_tensors(f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", cfg.norm),
        **(
            deepseek_moe_tensors(f"{param}.feed_forward", f"{hf}.mlp", ffn)
            if moe
            else mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", ffn)
        ),
    }

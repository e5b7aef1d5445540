"""The Hugging Face MoE architectures of the LLaMA layout (`axplug.architectures`): Mixtral,
Qwen2-MoE and Qwen3-MoE, with a `MoEFeedForward` (the core knows no MoE tensors); DeepSeek-V3
is in `axplug_moe.deepseek`.

Qwen2-MoE and Qwen3-MoE name the router `mlp.gate` and the experts
`mlp.experts.{e}.{gate,up,down}_proj` (what hub checkpoints hold and transformers 5 saves,
though it fuses them in memory); Qwen2-MoE adds one shared expert `mlp.shared_expert.*`
scaled by sigmoid(`mlp.shared_expert_gate` x). Both may mix dense layers in
(`decoder_sparse_step`, `mlp_only_layers`): a periodic mix is a stack of `MoELayerGroup`s,
any other is refused by name. DeepSeek-V3 names the same experts and router (with its
`e_score_correction_bias`) and `mlp.shared_experts.*`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from axplug_attention.llama import llama_base

from axplug.api import HFFields, HFTensor
from axplug.api.interop import (
    attention_tensors,
    decoder_tensors,
    linear_tensors,
    mlp_tensors,
    norm_tensors,
)

__all__ = [
    "Mixtral",
    "Qwen2Moe",
    "Qwen3Moe",
    "mixtral_expert_tensors",
    "qwen_moe_tensors",
]


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
    # Mixtral's code has no shared expert, whatever a config.json says.
    implied: Mapping[str, Any] = {
        "shared_expert_intermediate_size": None,
        "n_shared_experts": None,
    }

    def base_config(self, fields: HFFields) -> Any:
        from axplug.api.config import resolve_preset

        experts = fields.raw.get("num_local_experts", self.defaults["num_local_experts"])
        return llama_base(
            fields,
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


# --------------------------------------------------------------------- Qwen2-MoE, Qwen3-MoE


def qwen_moe_tensors(param: str, hf: str, moe: Any) -> dict[str, HFTensor]:
    """`mlp` <-> a `MoEFeedForward`: the router `gate` [experts, dim], expert e
    `experts.{e}.{gate,up,down}_proj` ([out, in] Linears, stacked on a leading axis here) and,
    with one, the shared expert `shared_expert.*` and its `shared_expert_gate` [1, dim]."""
    e = moe.num_experts
    out = linear_tensors(f"{param}.router", f"{hf}.gate", moe.router)
    for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
        name = f"{hf}.experts.{{e}}.{theirs}.weight"
        out[f"{param}.{ours}"] = HFTensor(name, transpose=True, experts=e)
    if moe.num_shared_experts:
        out.update(mlp_tensors(f"{param}.shared_expert", f"{hf}.shared_expert", moe.shared_expert))
    if moe.shared_expert_gate:
        out.update(linear_tensors(f"{param}.shared_expert_gate", f"{hf}.shared_expert_gate", False))
    return out


def _is_moe(ffn: Any) -> bool:
    from axplug_moe.layer import MoEFeedForward

    klass = getattr(ffn, "klass", None)
    return isinstance(klass, type) and issubclass(klass, MoEFeedForward)


def _sparse_step(fields: HFFields) -> int:
    """The period of the MoE layers config.json asks for (1: every layer is MoE).

    Hugging Face: layer i is MoE when i is not in `mlp_only_layers` and (i + 1) is a multiple
    of `decoder_sparse_step`; the others are dense MLPs of `intermediate_size`. A pattern that
    repeats every p layers (p dividing num_hidden_layers, MoE last) is a stack of
    `MoELayerGroup`s of p; any other mix is a problem naming the fields.
    """
    step = fields.positive_int("decoder_sparse_step", 1)
    only = fields.get("mlp_only_layers", [])
    layers = fields.raw.get(fields.name("num_hidden_layers"))
    if not step or not isinstance(layers, int) or layers < 1:
        return 1  # the stack reports num_hidden_layers itself
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    ):
        fields.problem(f"mlp_only_layers={only!r} (expected a list of layer indices)")
        return 1
    moe = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    for period in range(1, layers + 1):
        if layers % period == 0 and moe == [i % period == period - 1 for i in range(layers)]:
            return period
    dense = [i for i in range(layers) if not moe[i]]
    fields.problem(
        f"decoder_sparse_step={step} with mlp_only_layers={only} over {layers} layers makes "
        f"layers {dense} dense and the others MoE: only a mix that repeats (every p-th "
        "layer MoE, p dividing num_hidden_layers) is supported"
    )
    return 1


class Qwen2Moe:
    """Qwen2MoeForCausalLM: LLaMA with q/k/v biases and, in its MoE layers, softmax top-k
    routing (`norm_topk_prob`, by default not renormalized) plus one shared expert scaled
    by sigmoid(shared_expert_gate x)."""

    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    # Qwen2MoeConfig's defaults for what a config.json may leave out.
    defaults: Mapping[str, Any] = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "qkv_bias": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
    }
    aliases: Mapping[str, str] = {"num_local_experts": "num_experts"}
    # Fixed in Qwen2-MoE's code: no o_proj or MLP biases, the shared expert's sigmoid gate.
    implied: Mapping[str, Any] = {
        "attention_bias": False,
        "mlp_bias": False,
        "shared_expert_gate": True,
        "n_shared_experts": None,  # DeepSeek's form of shared experts
    }
    qk_norm = False

    def base_config(self, fields: HFFields) -> Any:
        from axplug.api.config import make_modifier
        from axplug.api.layers import RMSNorm

        _one_expert_count(fields)
        step = _sparse_step(fields)
        experts = fields.raw.get("num_experts", self.defaults["num_experts"])
        experts = experts if isinstance(experts, int) and experts > 0 else 1
        cfg = llama_base(fields)
        stack = cfg.model.decoder.transformer
        if self.qk_norm:  # before the MoE layers are made, so dense and MoE layers have it
            stack.layer.attention.set(qk_norm=RMSNorm.default_config(), qk_norm_over="head_dim")
        if step > 1:  # the modifier groups the stack: the depth config.json has
            stack.num_layers = fields.raw[fields.name("num_hidden_layers")]
        else:  # the dense MLPs' width, which no layer has when every layer is MoE
            fields.get("intermediate_size", None)
        moe = f"moe:num_experts={experts},every={step},capacity_factor=None"
        return make_modifier(moe)(cfg)

    def config_fields(self, model: Any) -> dict:
        """The MoE period this family reads in `base_config` (a MoELayerGroup's `every`)."""
        layer = model.decoder.transformer.layer
        return {"decoder_sparse_step": getattr(layer, "every", 1), "mlp_only_layers": []}

    def tensors(self, model: Any) -> dict[str, HFTensor]:
        qk_norm = self.qk_norm

        def one(cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            attn = f"{hf}.self_attn"
            out = {
                **norm_tensors(f"{param}.attention_norm", f"{hf}.input_layernorm", cfg.norm),
                **attention_tensors(f"{param}.attention", attn, cfg.attention),
                **norm_tensors(
                    f"{param}.feed_forward_norm", f"{hf}.post_attention_layernorm", cfg.norm
                ),
            }
            if qk_norm:
                qk = cfg.attention.qk_norm
                out.update(norm_tensors(f"{param}.attention.q_norm", f"{attn}.q_norm", qk))
                out.update(norm_tensors(f"{param}.attention.k_norm", f"{attn}.k_norm", qk))
            ffn = cfg.feed_forward
            if _is_moe(ffn):
                out.update(qwen_moe_tensors(f"{param}.feed_forward", f"{hf}.mlp", ffn))
            else:
                out.update(mlp_tensors(f"{param}.feed_forward", f"{hf}.mlp", ffn))
            return out

        def unit(g: int, cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
            every = getattr(cfg, "every", None)
            if every is None:  # a transformer layer
                return one(cfg, param, hf)
            prefix = hf.rpartition(".")[0]  # `model.layers`
            out: dict[str, HFTensor] = {}
            for j in range(every):  # a MoELayerGroup: every - 1 dense layers, then MoE
                sub = cfg.moe_layer if j == every - 1 else cfg.layer
                out.update(one(sub, f"{param}.layer{j}", f"{prefix}.{g * every + j}"))
            return out

        return decoder_tensors(model, unit)


class Qwen3Moe(Qwen2Moe):
    """Qwen3MoeForCausalLM: Qwen2-MoE without the shared expert and the q/k/v biases
    (`attention_bias` for all four projections), with an RMSNorm over each q and k head
    before RoPE; `norm_topk_prob` (False in Qwen3MoeConfig, True in the released models)."""

    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    defaults: Mapping[str, Any] = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
    }
    aliases: Mapping[str, str] = {"num_local_experts": "num_experts", "qkv_bias": "attention_bias"}
    # Fixed in Qwen3-MoE's code: no MLP biases, no shared expert.
    implied: Mapping[str, Any] = {
        "mlp_bias": False,
        "shared_expert_intermediate_size": None,
        "n_shared_experts": None,
    }
    qk_norm = True


def _one_expert_count(fields: HFFields) -> None:
    """`num_experts`, the name hub checkpoints use; transformers 5 saves Qwen3-MoE's as
    `num_local_experts` (its attribute_map): either is read, both must agree."""
    local = fields.raw.get("num_local_experts")
    if local is None or fields.name("num_local_experts") == "num_local_experts":
        return
    fields.read.add("num_local_experts")
    name = fields.name("num_local_experts")
    ours = fields.raw.setdefault(name, local)
    if ours != local:
        fields.problem(f"num_local_experts={local!r} and {name}={ours!r} disagree")

"""The Hugging Face Mixtral <-> axplug MoE parameter mapping, registered for `import-hf` and
`export-hf` under `axplug.hf_mappings` (the core knows no MoE tensors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["MixtralMapping"]


class MixtralMapping:
    """`block_sparse_moe` of a MixtralForCausalLM layer <-> a `MoEFeedForward`.

    Mixtral's expert j is w2(silu(w1 x) * w3 x): w1 = gate, w3 = up, w2 = down, each an
    [out, in] Linear; axplug stacks the experts on a leading axis, [in, out] each.
    """

    layer = "MoEFeedForward"
    architecture = "MixtralForCausalLM"

    def import_params(self, read: Callable[[str, tuple], np.ndarray], hf: Any, prefix: str):
        d, h, e = hf.hidden_size, hf.intermediate_size, hf.num_experts
        moe = f"{prefix}.block_sparse_moe"

        def experts(w: str, in_dim: int, out_dim: int) -> np.ndarray:
            return np.stack(
                [read(f"{moe}.experts.{j}.{w}.weight", (out_dim, in_dim)).T for j in range(e)]
            )

        return {
            "router": {"weight": read(f"{moe}.gate.weight", (e, d)).T},
            "wi_gate": experts("w1", d, h),
            "wi_up": experts("w3", d, h),
            "wo": experts("w2", h, d),
        }

    def export_tensors(self, params: dict, prefix: str) -> dict[str, np.ndarray]:
        moe = f"{prefix}.block_sparse_moe"
        out = {f"{moe}.gate.weight": np.asarray(params["router"]["weight"]).T}
        for name, w in (("wi_gate", "w1"), ("wi_up", "w3"), ("wo", "w2")):
            for j, weight in enumerate(np.asarray(params[name])):
                out[f"{moe}.experts.{j}.{w}.weight"] = weight.T
        return out

    def hf_config(self, ffn: Any) -> dict:
        """config.json fields of the MoE layer; what Mixtral cannot express is an error."""
        router = ffn.router
        problems = []
        if router.capacity_factor is not None:
            problems.append(f"capacity_factor={router.capacity_factor} (Mixtral drops nothing)")
        if not router.renormalize:
            problems.append("renormalize=False (Mixtral renormalizes the top-k gates)")
        if ffn.activation != "silu" or not ffn.gated:
            problems.append("experts that are not SwiGLU")
        if ffn.num_shared_experts:
            problems.append(f"{ffn.num_shared_experts} shared expert(s) (Mixtral has none)")
        if problems:
            raise ValueError("; ".join(problems))
        return {
            "num_local_experts": ffn.num_experts,
            "num_experts_per_tok": router.top_k,
            # import-hf multiplies Mixtral's coefficient by top_k (axplug averages the k
            # choices), so the inverse divides.
            "router_aux_loss_coef": router.load_balance_coefficient / router.top_k,
        }

"""Hugging Face LLaMA / Mixtral tensors -> the parameter tree of the imported axplug model.

HF `nn.Linear` weights are [out, in]; axplug's `Linear` is [in, out], so every projection is
transposed. Hugging Face checkpoints already lay q/k rows out for `rotate_half` RoPE (pairs
(i, i + head_dim/2)), which is axplug's non-interleaved RoPE: no row permutation is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug.interop.hf_config import HFImportError, HFModelConfig
from axplug.interop.safetensors_dir import SafetensorsDir

__all__ = ["hf_params", "IGNORED_SUFFIXES"]

# Tensors some checkpoints carry that are buffers, not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_params(tensors: SafetensorsDir, hf: HFModelConfig, specs: dict) -> dict:
    """Numpy parameters with exactly the structure, shapes and dtypes of `specs` (the model's
    `create_parameter_specs_recursively()`), for an unrolled or a scanned layer stack."""
    d, v = hf.hidden_size, hf.vocab_size
    decoder: dict[str, Any] = {
        "embedding": {"weight": tensors.get("model.embed_tokens.weight", (v, d))},
        "output_norm": {"scale": tensors.get("model.norm.weight", (d,))},
    }
    if not hf.tie_word_embeddings:
        decoder["lm_head"] = {"weight": _linear(tensors, "lm_head.weight", d, v)}
    layers = [_layer(tensors, hf, i) for i in range(hf.num_layers)]
    stack_specs = specs.get("decoder", {}).get("transformer", {})
    if "layer" in stack_specs and "layer0" not in stack_specs:  # scanned: a leading layer axis
        decoder["transformer"] = {"layer": _stack(layers)}
    else:
        decoder["transformer"] = {f"layer{i}": layer for i, layer in enumerate(layers)}
    return _conform({"decoder": decoder}, specs)


def _linear(tensors: SafetensorsDir, name: str, in_dim: int, out_dim: int) -> np.ndarray:
    return tensors.get(name, (out_dim, in_dim)).T


def _layer(tensors: SafetensorsDir, hf: HFModelConfig, i: int) -> dict:
    p = f"model.layers.{i}"
    d, q_dim, kv_dim = hf.hidden_size, hf.num_heads * hf.head_dim, hf.num_kv_heads * hf.head_dim
    attn = f"{p}.self_attn"
    return {
        "attention_norm": {"scale": tensors.get(f"{p}.input_layernorm.weight", (d,))},
        "attention": {
            "qkv": {
                "q": {"weight": _linear(tensors, f"{attn}.q_proj.weight", d, q_dim)},
                "k": {"weight": _linear(tensors, f"{attn}.k_proj.weight", d, kv_dim)},
                "v": {"weight": _linear(tensors, f"{attn}.v_proj.weight", d, kv_dim)},
            },
            "output": {"weight": _linear(tensors, f"{attn}.o_proj.weight", q_dim, d)},
        },
        "feed_forward_norm": {"scale": tensors.get(f"{p}.post_attention_layernorm.weight", (d,))},
        "feed_forward": _moe(tensors, hf, p) if hf.is_moe else _mlp(tensors, hf, p),
    }


def _mlp(tensors: SafetensorsDir, hf: HFModelConfig, p: str) -> dict:
    d, h = hf.hidden_size, hf.intermediate_size
    return {
        "wi_gate": {"weight": _linear(tensors, f"{p}.mlp.gate_proj.weight", d, h)},
        "wi_up": {"weight": _linear(tensors, f"{p}.mlp.up_proj.weight", d, h)},
        "wo": {"weight": _linear(tensors, f"{p}.mlp.down_proj.weight", h, d)},
    }


def _moe(tensors: SafetensorsDir, hf: HFModelConfig, p: str) -> dict:
    """A Mixtral layer's experts, through the mapping the MoE plugin registers."""
    from axplug.interop.hf_mappings import mapping_for_architecture

    return mapping_for_architecture(hf.architecture).import_params(tensors.get, hf, p)


def _stack(layers: list[dict]) -> dict:
    first = layers[0]
    if isinstance(first, dict):
        return {k: _stack([layer[k] for layer in layers]) for k in first}
    return np.stack(layers)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _conform(params: dict, specs: dict) -> dict:
    """`params` cast to the specs' dtypes, after checking both trees have the same leaves and
    shapes (a modifier or override can change the model so the HF weights no longer fit)."""
    got, want = _flatten(params, "model"), _flatten(specs, "model")
    missing = sorted(set(want) - set(got))
    if missing:
        raise HFImportError(
            f"the axplug model has parameter(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} with no Hugging Face tensor; a modifier or "
            "override changed the model's structure"
        )
    extra = sorted(set(got) - set(want))
    if extra:
        raise HFImportError(
            f"Hugging Face tensors map to {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
            ", which the axplug model does not have; a modifier or override changed the "
            "model's structure"
        )
    out = {}
    for path, spec in want.items():  # spec: a ParameterSpec
        value = got[path]
        if tuple(value.shape) != tuple(spec.shape):
            raise HFImportError(
                f"{path}: the axplug model expects shape {list(spec.shape)}, the Hugging "
                f"Face weights give {list(value.shape)}; an override changed a dimension"
            )
        out[path] = np.asarray(value).astype(spec.dtype)
    return _unflatten(out)["model"]

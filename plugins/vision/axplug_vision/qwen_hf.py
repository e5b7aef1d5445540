"""Qwen2.5-VL's Hugging Face vision tower (`vision_config`, `model.visual.*` tensors) to and
from a `QwenVisionTower` config and parameters."""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug.api.config import ConfigError
from axplug.api.layers import HF_ACTIVATIONS
from axplug_vision.qwen_tower import QwenVisionTower

__all__ = ["qwen_tower_config", "qwen_tower_params", "qwen_tower_tensors"]

VISION_MODEL_TYPES = ("qwen2_5_vl_vision", "qwen2_5_vl")  # the second: older checkpoints'
# Where the tower's tensors sit: transformers 5's whole model, the Hub checkpoints' files, the
# tower alone.
PREFIXES = ("model.visual.", "visual.", "")


def _int(hf: dict, name: str, default: Any = None) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"vision_config.{name}={value!r}: expected a positive int")
    return value


def qwen_tower_config(vision_config: dict) -> Any:
    """The `QwenVisionTower` config of a Qwen2.5-VL `vision_config` (its `to_dict()`)."""
    hf = vision_config
    kind = hf.get("model_type", VISION_MODEL_TYPES[0])
    if kind not in VISION_MODEL_TYPES:
        raise ConfigError(
            f"vision_config.model_type={kind!r}: not Qwen2.5-VL's vision tower "
            f"({VISION_MODEL_TYPES[0]!r})"
        )
    act = hf.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise ConfigError(
            f"vision_config.hidden_act={act!r}: not an activation axplug computes "
            f"(supported: {', '.join(HF_ACTIVATIONS)})"
        )
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(
            f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: the vision "
            "tower's rotary is 'axial'"
        )
    dim, heads = _int(hf, "hidden_size"), _int(hf, "num_heads")
    if dim % heads:
        raise ConfigError(f"vision_config.hidden_size={dim} is not divisible by num_heads={heads}")
    depth = _int(hf, "depth")
    cfg = QwenVisionTower.default_config().set(
        in_channels=_int(hf, "in_channels", 3),
        patch_size=_int(hf, "patch_size", 14),
        temporal_patch_size=_int(hf, "temporal_patch_size", 2),
        spatial_merge_size=_int(hf, "spatial_merge_size", 2),
        window_size=_int(hf, "window_size", 112),
        dim=dim,
        out_dim=_int(hf, "out_hidden_size"),
        full_attention_layers=tuple(
            int(i) for i in hf.get("fullatt_block_indexes", (7, 15, 23, 31))
        ),
    )
    cfg.transformer.num_layers = depth
    layer = cfg.transformer.layer
    layer.attention.num_heads = heads
    layer.attention.position.theta = float(rope.get("rope_theta", 10000.0))
    layer.feed_forward.set(hidden_dim=_int(hf, "intermediate_size"), activation=HF_ACTIVATIONS[act])
    return cfg


Names = dict[tuple[str, ...], tuple[str, int | None]]


def _tensor_names(cfg: Any) -> Names:
    """axplug parameter path -> (the tower's tensor name, which third of a fused q/k/v tensor
    or None). Matrices are [in, out] here, [out, in] there."""

    def linear(path: tuple[str, ...], name: str, third: int | None = None) -> Names:
        return {
            (*path, "weight"): (f"{name}.weight", third),
            (*path, "bias"): (f"{name}.bias", third),
        }

    names: Names = {("patch_embedding", "weight"): ("patch_embed.proj.weight", None)}
    for i in range(cfg.transformer.num_layers):
        at, block = ("transformer", f"layer{i}"), f"blocks.{i}."
        names[(*at, "attention_norm", "scale")] = (block + "norm1.weight", None)
        names[(*at, "feed_forward_norm", "scale")] = (block + "norm2.weight", None)
        for third, part in enumerate("qkv"):
            names |= linear((*at, "attention", "qkv", part), block + "attn.qkv", third)
        names |= linear((*at, "attention", "output"), block + "attn.proj")
        for ours, theirs in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
            names |= linear((*at, "feed_forward", ours), f"{block}mlp.{theirs}")
    names[("merger", "norm", "scale")] = ("merger.ln_q.weight", None)
    names |= linear(("merger", "hidden"), "merger.mlp.0")
    names |= linear(("merger", "output"), "merger.mlp.2")
    return names


def qwen_tower_params(state: dict, cfg: Any) -> dict:
    """`QwenVisionTower` parameters (of `cfg`) from a state dict of numpy arrays: a whole
    Qwen2.5-VL model's (`model.visual.` or `visual.`) or the tower's own."""
    prefix = next((p for p in PREFIXES if p + "merger.ln_q.weight" in state), None)
    if prefix is None:
        raise ConfigError(
            "state: no Qwen2.5-VL vision tower tensors (merger.ln_q.weight under any of "
            f"{', '.join(repr(p) for p in PREFIXES)})"
        )
    params: dict = {}
    for path, (name, third) in _tensor_names(cfg).items():
        value = np.asarray(state[prefix + name], np.float32)
        if third is not None:
            value = np.split(value, 3)[third]
        if path[0] == "patch_embedding":  # [dim, channels, time, row, column]
            value = value.reshape(value.shape[0], -1)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value.T if value.ndim == 2 else value
    return params


def qwen_tower_tensors(params: dict, cfg: Any, prefix: str = "model.visual.") -> dict:
    """The tower's tensors (numpy, named as transformers' Qwen2.5-VL under `prefix`) of
    `QwenVisionTower` parameters: `qwen_tower_params`' inverse."""
    parts: dict[str, list] = {}
    for path, (name, _) in _tensor_names(cfg).items():
        node = params
        for key in path[:-1]:
            node = node[key]
        value = np.asarray(node[path[-1]])
        parts.setdefault(prefix + name, []).append(value.T if value.ndim == 2 else value)
    tensors = {name: np.concatenate(p) if len(p) > 1 else p[0] for name, p in parts.items()}
    patch = (cfg.dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    tensors[prefix + "patch_embed.proj.weight"] = tensors[
        prefix + "patch_embed.proj.weight"
    ].reshape(patch)
    return tensors

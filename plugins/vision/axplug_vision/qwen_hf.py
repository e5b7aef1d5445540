"""Qwen2.5-VL's Hugging Face vision tower (`vision_config`, `visual.*` tensors) to and from a
`QwenVisionTower` config and parameters."""

from __future__ import annotations

from typing import Any

import numpy as np

from axplug.api import HFFields, HFTensor
from axplug.api.config import ConfigError
from axplug.api.interop import linear_tensors, norm_tensors, read_fields, unflatten
from axplug_vision.qwen_tower import VISION_MODEL_TYPE, QwenVisionTower

__all__ = ["qwen_tower_config", "qwen_tower_params", "qwen_tower_tensors"]

# Where the tower's tensors sit: the checkpoints' files (transformers 5 saves them so too),
# transformers 5's model in memory, the tower alone.
PREFIXES = ("visual.", "model.visual.", "")


def qwen_tower_config(vision_config: dict) -> Any:
    """The `QwenVisionTower` config of a Qwen2.5-VL `vision_config` (its `to_dict()`)."""
    kind = vision_config.get("model_type", VISION_MODEL_TYPE)
    defaults = QwenVisionTower.hf_defaults.get(kind, {})
    fields = HFFields(vision_config, source="vision_config", defaults=defaults,
                      aliases=QwenVisionTower.hf_aliases)  # fmt: skip
    cfg = QwenVisionTower.default_config()
    read_fields(cfg, fields)
    unread = (f"{n}={v!r} is read by no layer" for n, v in fields.unread().items())
    problems = [*fields.problems, *unread]
    if problems:
        raise ConfigError("vision_config: " + "; ".join(problems))
    return cfg


def qwen_tower_tensors(cfg: Any, param: str, hf: str) -> dict[str, HFTensor]:
    """Every parameter of the tower `cfg` at `param` from its tensors under `hf` (`visual.`):
    each fused q/k/v tensor read as three parts."""
    norm, dim = cfg.transformer.layer.norm, cfg.dim
    out = {
        f"{param}.patch_weight": HFTensor(f"{hf}patch_embed.proj.weight"),
        **norm_tensors(f"{param}.merger.norm", f"{hf}merger.ln_q", norm),
        **linear_tensors(f"{param}.merger.hidden", f"{hf}merger.mlp.0", True),
        **linear_tensors(f"{param}.merger.output", f"{hf}merger.mlp.2", True),
    }
    for i in range(cfg.transformer.num_layers):
        at, to = f"{param}.transformer.layer{i}", f"{hf}blocks.{i}"
        out.update(
            {
                **norm_tensors(f"{at}.attention_norm", f"{to}.norm1", norm),
                **norm_tensors(f"{at}.feed_forward_norm", f"{to}.norm2", norm),
                **linear_tensors(f"{at}.attention.output", f"{to}.attn.proj", True),
                **linear_tensors(f"{at}.feed_forward.wi_gate", f"{to}.mlp.gate_proj", True),
                **linear_tensors(f"{at}.feed_forward.wi_up", f"{to}.mlp.up_proj", True),
                **linear_tensors(f"{at}.feed_forward.wo", f"{to}.mlp.down_proj", True),
            }
        )
        for third, name in enumerate("qkv"):
            part = (0, third * dim, (third + 1) * dim)
            out[f"{at}.attention.qkv.{name}.weight"] = HFTensor(
                f"{to}.attn.qkv.weight", transpose=True, part=part
            )
            out[f"{at}.attention.qkv.{name}.bias"] = HFTensor(f"{to}.attn.qkv.bias", part=part)
    return out


def qwen_tower_params(state: dict, cfg: Any) -> dict:
    """`QwenVisionTower` parameters (of `cfg`) from a state dict of numpy arrays: a whole
    Qwen2.5-VL model's (`visual.` or `model.visual.`) or the tower's own."""
    prefix = next((p for p in PREFIXES if p + "merger.ln_q.weight" in state), None)
    if prefix is None:
        raise ConfigError(
            "state: no Qwen2.5-VL vision tower tensors (merger.ln_q.weight under any of "
            f"{', '.join(repr(p) for p in PREFIXES)})"
        )
    flat = {}
    for path, rule in qwen_tower_tensors(cfg, "tower", prefix).items():
        value = np.asarray(state[rule.name], np.float32)
        if rule.part is not None:
            _, start, stop = rule.part
            value = value[start:stop]
        flat[path.removeprefix("tower.")] = value.T if rule.transpose else value
    return unflatten(flat)

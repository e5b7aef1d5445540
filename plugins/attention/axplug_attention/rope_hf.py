"""RoPE in Hugging Face config.json: `rope_parameters` (transformers 5), `rope_theta` +
`rope_scaling` (transformers 4), Llama 3, linear and YaRN scaling, and the per-layer-type
form (Gemma 3), read into and written from RotaryPositionTransform fields."""

from __future__ import annotations

from typing import Any

__all__ = ["read_rope", "write_rope", "per_layer_type", "LAYER_TYPES", "GLOBAL_LAYER_TYPE"]

_THETA = 10000.0  # transformers' default where config.json has no rope_theta
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# The layer kinds of a Hugging Face `layer_types` list that a `rope_parameters` may be keyed by
# (transformers 5 writes Gemma 3's RoPE so: one entry per kind).
LAYER_TYPES = ("full_attention", "sliding_attention")
GLOBAL_LAYER_TYPE = LAYER_TYPES[0]  # the entry a layer template takes: transformers 4's global RoPE


def per_layer_type(params: Any) -> bool:
    """Whether a `rope_parameters` value is keyed by layer type (one RoPE per kind)."""
    return (
        isinstance(params, dict)
        and bool(params)
        and set(params) <= set(LAYER_TYPES)
        and all(isinstance(v, dict) for v in params.values())
    )


def read_rope(
    fields, layer_type: str | None = None, *, theta_field: str = "rope_theta"
) -> dict[str, Any]:
    """The RotaryPositionTransform fields a config.json sets, its problems recorded: `theta`,
    `scaling_factor` (Llama 3, with its three band fields when set), `linear_scaling_factor`
    and `yarn_factor` (with its `yarn_*` fields), from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (transformers 4).

    `layer_type`: read that entry of a `rope_parameters` keyed by layer type, whose missing
    `rope_theta` falls back to the field `theta_field` (Gemma 3: `rope_local_base_freq` for
    the sliding layers; absent too: 10000, transformers' default). Both forms are always read,
    so neither is left unread.
    """
    params = fields.get("rope_parameters", None)
    legacy = fields.get("rope_scaling", None)
    fallback = fields.get(theta_field, _THETA)
    if layer_type is not None and per_layer_type(params):
        name, scaling = f"rope_parameters.{layer_type}", params.get(layer_type, {})
        theta = scaling.get("rope_theta", fallback)
    elif isinstance(params, dict):
        name, scaling = "rope_parameters", params
        theta = params.get("rope_theta", fallback)
    else:
        name, scaling = "rope_scaling", legacy
        theta = fallback
    out: dict[str, Any] = {
        "scaling_factor": None,
        "linear_scaling_factor": None,
        "yarn_factor": None,
    }
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        fields.problem(f"{theta_field}={theta!r} (expected a positive number)")
        theta = 1.0
    out["theta"] = float(theta)
    if not scaling:
        return out
    if not isinstance(scaling, dict):
        fields.problem(f"{name}={scaling!r} (expected an object)")
        return out
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return out
    if kind == "yarn":
        return {**out, **_read_yarn(fields, name, scaling)}
    if kind not in ("llama3", "linear"):
        fields.problem(
            f"{name}.rope_type={kind!r} (supported: 'default', 'linear', 'llama3' and 'yarn'; "
            "dynamic and longrope scaling are not)"
        )
        return out
    if scaling.get("attention_factor", 1.0) not in (None, 1.0):
        fields.problem(f"{name}.attention_factor={scaling['attention_factor']!r} (only 1.0)")
    if kind == "linear":
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            fields.problem(f"{name}.factor={factor!r} (rope_type 'linear' needs a positive one)")
            return out
        out["linear_scaling_factor"] = float(factor)
        return out
    absent = [k for k in _LLAMA3_KEYS if not isinstance(scaling.get(k), (int, float))]
    if absent:
        fields.problem(f"{name} of rope_type 'llama3' lacks {', '.join(absent)}")
        return out
    out["scaling_factor"] = float(scaling["factor"])
    out["low_freq_factor"] = float(scaling["low_freq_factor"])
    out["high_freq_factor"] = float(scaling["high_freq_factor"])
    out["original_max_position"] = int(scaling["original_max_position_embeddings"])
    return out


def _read_yarn(fields, name: str, scaling: dict) -> dict[str, Any]:
    """The yarn_* fields of a YaRN scaling, as transformers reads it ({}: problems recorded)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    absent = [
        k for k in ("factor", "original_max_position_embeddings") if not number(scaling.get(k))
    ]
    if absent:
        fields.problem(
            f"{name} of rope_type 'yarn' lacks {', '.join(absent)} (a factor derived from "
            "max_position_embeddings is not supported)"
        )
        return {}
    out: dict[str, Any] = {
        "yarn_factor": float(scaling["factor"]),
        "original_max_position": int(scaling["original_max_position_embeddings"]),
        # transformers reads them with `or`: null and 0 are the defaults.
        "yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
        "yarn_truncate": bool(scaling.get("truncate", True)),
    }
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and not number(value):
            fields.problem(f"{name}.{key}={value!r} (expected a number)")
            value = None
        out[f"yarn_{key}"] = None if value is None else float(value)
    return out


def write_rope(cfg: Any) -> dict[str, Any]:
    """A RotaryPositionTransform config's RoPE in every form transformers reads (4:
    rope_theta / rope_scaling, 5: rope_parameters), so no stale form survives an export;
    what config.json cannot express raises ValueError."""
    if cfg.interleaved:
        raise ValueError("interleaved RoPE (Hugging Face rotates halves: interleaved=False)")
    params: dict = {"rope_type": "default", "rope_theta": cfg.theta}
    scaling = None
    scalings = [cfg.scaling_factor, cfg.linear_scaling_factor, cfg.yarn_factor]
    if sum(f is not None for f in scalings) > 1:
        raise ValueError(
            "RoPE has more than one of Llama 3, linear and YaRN scaling (Hugging Face has "
            "one rope_type)"
        )
    if cfg.yarn_factor is not None:
        scaling = {
            "rope_type": "yarn",
            "factor": cfg.yarn_factor,
            "original_max_position_embeddings": cfg.original_max_position,
            "beta_fast": cfg.yarn_beta_fast,
            "beta_slow": cfg.yarn_beta_slow,
            "mscale": cfg.yarn_mscale,
            "mscale_all_dim": cfg.yarn_mscale_all_dim,
        }
        if cfg.yarn_attention_factor is not None:
            scaling["attention_factor"] = cfg.yarn_attention_factor
        if not cfg.yarn_truncate:
            scaling["truncate"] = False
        params = {**scaling, "rope_theta": cfg.theta}
    if cfg.linear_scaling_factor is not None:
        scaling = {"rope_type": "linear", "factor": cfg.linear_scaling_factor}
        params = {**scaling, "rope_theta": cfg.theta}
    if cfg.scaling_factor is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.scaling_factor,
            "low_freq_factor": cfg.low_freq_factor,
            "high_freq_factor": cfg.high_freq_factor,
            "original_max_position_embeddings": cfg.original_max_position,
        }
        params = {**scaling, "rope_theta": cfg.theta}
    # Written when whole too: a family whose Hugging Face default is a part (StableLM's 0.25)
    # would read an absent factor as that part.
    params["partial_rotary_factor"] = cfg.rotary_fraction
    return {
        "rope_theta": cfg.theta, "rope_scaling": scaling, "rope_parameters": params,
        "partial_rotary_factor": cfg.rotary_fraction,
    }  # fmt: skip

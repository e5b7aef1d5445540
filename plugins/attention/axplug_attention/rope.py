"""Rotary position embedding (RoPE) for the attention `position` slot."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.config import ConfigError, config_class
from axplug.layers import BaseLayer

__all__ = [
    "RotaryPositionTransform",
    "rope_frequencies",
    "rope_tables",
    "apply_rope",
    "read_rope",
    "per_layer_type",
    "LAYER_TYPES",
]


def rope_frequencies(
    rotary_dim: int,
    *,
    theta: float = 10000.0,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
    linear_scaling_factor: float | None = None,
) -> np.ndarray:
    """Angular frequency of each rotated pair, [rotary_dim // 2] float32.

    With `scaling_factor` (Llama 3.1: 8), wavelengths longer than
    `original_max_position / low_freq_factor` are stretched by the factor, those shorter than
    `original_max_position / high_freq_factor` are kept, and the band between is interpolated.
    With `linear_scaling_factor` every frequency is divided by it, i.e. positions are (linear
    position interpolation: Hugging Face's rope_type "linear", Gemma 3's global layers).
    """
    freqs = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling_factor is not None:
        wavelen = 2 * math.pi / freqs
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        smooth = (original_max_position / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        mid = (1 - smooth) * freqs / scaling_factor + smooth * freqs
        freqs = np.where(
            wavelen < high_wavelen,
            freqs,
            np.where(wavelen > low_wavelen, freqs / scaling_factor, mid),
        )
    if linear_scaling_factor is not None:
        freqs = freqs / linear_scaling_factor
    return freqs.astype(np.float32)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    freqs: np.ndarray,
    *,
    interleaved: bool = False,
    tables: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Rotates the first 2 * len(freqs) dims of `x` [b, s, heads, d] by `positions` [b, s].

    Pairs are (i, i + rotary_dim/2) (the GPT-NeoX / Hugging Face Llama layout) or, when
    `interleaved`, (2i, 2i + 1) (the original Llama / GPT-J layout). Computed in float32.
    `tables`: the (cos, sin) of `rope_tables(positions, freqs)`, when already computed.
    """
    rot = 2 * len(freqs)
    cos, sin = tables if tables is not None else rope_tables(positions, freqs)
    xr = x[..., :rot].astype(jnp.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if interleaved:
        rotated = jnp.stack([y1, y2], axis=-1).reshape(xr.shape)
    else:
        rotated = jnp.concatenate([y1, y2], axis=-1)
    if rot == x.shape[-1]:
        return rotated.astype(x.dtype)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rot:]], axis=-1)


def rope_tables(positions: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) of positions [b, s] times freqs, each [b, s, 1, len(freqs)] in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


_THETA = 10000.0  # transformers' default where config.json has no rope_theta
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# The layer kinds of a Hugging Face `layer_types` list that a `rope_parameters` may be keyed by
# (transformers 5 writes Gemma 3's RoPE so: one entry per kind).
LAYER_TYPES = ("full_attention", "sliding_attention")
_GLOBAL = LAYER_TYPES[0]  # the entry a layer template takes: transformers 4's global RoPE


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
    `scaling_factor` (Llama 3, with its three band fields when set) and
    `linear_scaling_factor`, from `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling` (transformers 4).

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
    out: dict[str, Any] = {"scaling_factor": None, "linear_scaling_factor": None}
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
    if kind not in ("llama3", "linear"):
        fields.problem(
            f"{name}.rope_type={kind!r} (supported: 'default', 'linear' and 'llama3'; "
            "dynamic, yarn and longrope scaling are not)"
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


class RotaryPositionTransform(BaseLayer):
    """RoPE: rotates q and k by their own positions, so q.k depends on the relative offset."""

    @config_class
    class Config(BaseLayer.Config):
        head_dim: int | None = None  # set by Attention; None: taken from q
        theta: float = 10000.0
        # Fraction of each head's dims that is rotated (partial rotary); the rest pass through.
        rotary_fraction: float = 1.0
        interleaved: bool = False
        # Llama 3 frequency scaling for long context; None disables it.
        scaling_factor: float | None = None
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_position: int = 8192
        # Linear position interpolation (Hugging Face's rope_type "linear"): every frequency
        # divided by the factor, as if positions were; None disables it.
        linear_scaling_factor: float | None = None

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """theta, Llama 3 or linear scaling and the rotated fraction, from `rope_parameters`
        (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4).

        A `rope_parameters` keyed by layer type (Gemma 3) needs a parent that read it first: a
        stack that sets its layers' RoPE per kind (`patterned_transformer` of axplug-models).
        The layer template then takes the `full_attention` entry, as `rope_theta` and
        `rope_scaling` are the global layers' in the transformers 4 form."""
        name = fields.name("rope_parameters")
        keyed = per_layer_type(fields.raw.get(name))
        if keyed and name not in fields.read:
            fields.problem(
                f"rope_parameters is keyed by layer type ({', '.join(fields.raw[name])}): one "
                "RoPE for every layer here (a per-layer pattern needs an architecture that "
                "builds one)"
            )
        cfg.set(**read_rope(fields, _GLOBAL if keyed else None))
        cfg.interleaved = False  # Hugging Face checkpoints lay q/k out for rotate_half
        params = fields.get("rope_parameters", None)
        entry = params.get(_GLOBAL) if keyed else params
        partial = entry.get("partial_rotary_factor") if isinstance(entry, dict) else None
        top = fields.number("partial_rotary_factor", 1.0)  # transformers 4 keeps it here
        cfg.rotary_fraction = float(partial) if partial else top

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        """The RoPE in every form transformers reads (4: rope_theta/rope_scaling, 5:
        rope_parameters), so no stale form survives an export."""
        if cfg.interleaved:
            raise ValueError("interleaved RoPE (Hugging Face rotates halves: interleaved=False)")
        params: dict = {"rope_type": "default", "rope_theta": cfg.theta}
        scaling = None
        if cfg.scaling_factor is not None and cfg.linear_scaling_factor is not None:
            raise ValueError(
                "RoPE has both Llama 3 and linear scaling (Hugging Face has one rope_type)"
            )
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
        if cfg.rotary_fraction != 1.0:
            params["partial_rotary_factor"] = cfg.rotary_fraction
        out = {"rope_theta": cfg.theta, "rope_scaling": scaling, "rope_parameters": params}
        if cfg.rotary_fraction != 1.0:
            out["partial_rotary_factor"] = cfg.rotary_fraction
        return out

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if not 0.0 < cfg.rotary_fraction <= 1.0:
            raise ConfigError(
                f"{self.path}.rotary_fraction: {cfg.rotary_fraction} is not in (0, 1]"
            )
        if cfg.scaling_factor is not None and cfg.high_freq_factor <= cfg.low_freq_factor:
            raise ConfigError(
                f"{self.path}: high_freq_factor ({cfg.high_freq_factor}) must exceed "
                f"low_freq_factor ({cfg.low_freq_factor})"
            )
        if cfg.linear_scaling_factor is not None and cfg.linear_scaling_factor <= 0:
            raise cfg.field_error(
                "linear_scaling_factor", f"{cfg.linear_scaling_factor} is not a positive factor"
            )
        if cfg.head_dim is not None:
            self.rotary_dim(cfg.head_dim)  # fail at build time, not at the first call

    def rotary_dim(self, head_dim: int) -> int:
        """The number of rotated dims: the even floor of head_dim * rotary_fraction."""
        rot = int(head_dim * self._config.rotary_fraction) // 2 * 2
        if rot == 0:
            raise ConfigError(
                f"{self.path}: rotary_fraction {self._config.rotary_fraction} of head_dim "
                f"{head_dim} rotates no pair of dims"
            )
        return rot

    def frequencies(self, head_dim: int) -> np.ndarray:
        cfg = self._config
        return rope_frequencies(
            self.rotary_dim(head_dim),
            theta=cfg.theta,
            scaling_factor=cfg.scaling_factor,
            low_freq_factor=cfg.low_freq_factor,
            high_freq_factor=cfg.high_freq_factor,
            original_max_position=cfg.original_max_position,
            linear_scaling_factor=cfg.linear_scaling_factor,
        )

    def forward(self, q, k, *, q_positions, kv_positions):
        # q: [b, sq, h, d], k: [b, skv, kvh, d]; positions are data (packing, decode offsets).
        freqs = self.frequencies(q.shape[-1])
        interleaved = self._config.interleaved
        q_tables = rope_tables(q_positions, freqs)
        # Self-attention without a cache passes one positions array for both: one table.
        kv_tables = q_tables if kv_positions is q_positions else None
        return (
            apply_rope(q, q_positions, freqs, interleaved=interleaved, tables=q_tables),
            apply_rope(k, kv_positions, freqs, interleaved=interleaved, tables=kv_tables),
        )

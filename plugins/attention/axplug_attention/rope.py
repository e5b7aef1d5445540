"""Rotary position embedding (RoPE) for the attention `position` slot."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api.config import ConfigError, config_class
from axplug.api.layers import BaseLayer
from axplug_attention.rope_hf import GLOBAL_LAYER_TYPE, per_layer_type, read_rope, write_rope

__all__ = [
    "RotaryPositionTransform",
    "rope_frequencies",
    "yarn_frequencies",
    "yarn_mscale",
    "rope_tables",
    "apply_rope",
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


def yarn_frequencies(
    rotary_dim: int,
    *,
    theta: float,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> np.ndarray:
    """YaRN's angular frequencies, [rotary_dim // 2] float32: pairs that turn fewer than
    `beta_slow` times over `original_max_position` are interpolated (divided by `factor`),
    those that turn more than `beta_fast` times are kept, with a linear ramp between (the
    correction range of the YaRN paper, as transformers computes it)."""

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    # In float32 like transformers.
    powers = np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    extrapolation = 1.0 / powers
    interpolation = 1.0 / (np.float32(factor) * powers)
    keep = 1 - ramp
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
        # YaRN (Hugging Face's rope_type "yarn"): frequencies by `yarn_frequencies` over
        # original_max_position, the rotated dims scaled by `yarn_attention_factor` (None:
        # derived from yarn_mscale / yarn_mscale_all_dim as transformers does); None disables.
        yarn_factor: float | None = None
        yarn_beta_fast: float = 32.0
        yarn_beta_slow: float = 1.0
        yarn_truncate: bool = True
        yarn_attention_factor: float | None = None
        yarn_mscale: float | None = None
        yarn_mscale_all_dim: float | None = None

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """theta, Llama 3, linear or YaRN scaling and the rotated fraction, from `rope_parameters`
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
        cfg.set(**read_rope(fields, GLOBAL_LAYER_TYPE if keyed else None))
        cfg.interleaved = False  # Hugging Face checkpoints lay q/k out for rotate_half
        params = fields.get("rope_parameters", None)
        entry = params.get(GLOBAL_LAYER_TYPE) if keyed else params
        partial = entry.get("partial_rotary_factor") if isinstance(entry, dict) else None
        top = fields.number("partial_rotary_factor", 1.0)  # transformers 4 keeps it here
        cfg.rotary_fraction = float(partial) if partial else top

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        """The RoPE in every form transformers reads (`write_rope`)."""
        return write_rope(cfg)

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
        if cfg.yarn_factor is not None and cfg.yarn_factor <= 0:
            raise cfg.field_error("yarn_factor", f"{cfg.yarn_factor} is not a positive factor")
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
        if cfg.yarn_factor is not None:
            return yarn_frequencies(
                self.rotary_dim(head_dim),
                theta=cfg.theta,
                factor=cfg.yarn_factor,
                original_max_position=cfg.original_max_position,
                beta_fast=cfg.yarn_beta_fast,
                beta_slow=cfg.yarn_beta_slow,
                truncate=cfg.yarn_truncate,
            )
        return rope_frequencies(
            self.rotary_dim(head_dim),
            theta=cfg.theta,
            scaling_factor=cfg.scaling_factor,
            low_freq_factor=cfg.low_freq_factor,
            high_freq_factor=cfg.high_freq_factor,
            original_max_position=cfg.original_max_position,
            linear_scaling_factor=cfg.linear_scaling_factor,
        )

    def attention_factor(self) -> float:
        """The scale of the rotated dims: YaRN's (1 without it)."""
        cfg = self._config
        if cfg.yarn_factor is None:
            return 1.0
        if cfg.yarn_attention_factor is not None:
            return cfg.yarn_attention_factor
        if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
            return yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale) / yarn_mscale(
                cfg.yarn_factor, cfg.yarn_mscale_all_dim
            )
        return yarn_mscale(cfg.yarn_factor)

    def forward(self, q, k, *, q_positions, kv_positions):
        # q: [b, sq, h, d], k: [b, skv, kvh, d]; positions are data (packing, decode offsets).
        freqs = self.frequencies(q.shape[-1])
        interleaved = self._config.interleaved
        factor = self.attention_factor()

        def tables(positions):
            cos, sin = rope_tables(positions, freqs)
            return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)

        q_tables = tables(q_positions)
        # Self-attention without a cache passes one positions array for both: one table.
        kv_tables = q_tables if kv_positions is q_positions else tables(kv_positions)
        return (
            apply_rope(q, q_positions, freqs, interleaved=interleaved, tables=q_tables),
            apply_rope(k, kv_positions, freqs, interleaved=interleaved, tables=kv_tables),
        )

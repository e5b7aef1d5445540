"""Rotary position embedding (RoPE) for the attention `position` slot."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from axplug.config import ConfigError, config_class
from axplug.layers import BaseLayer

__all__ = ["RotaryPositionTransform", "rope_frequencies", "rope_tables", "apply_rope"]


def rope_frequencies(
    rotary_dim: int,
    *,
    theta: float = 10000.0,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> np.ndarray:
    """Angular frequency of each rotated pair, [rotary_dim // 2] float32.

    With `scaling_factor` (Llama 3.1: 8), wavelengths longer than
    `original_max_position / low_freq_factor` are stretched by the factor, those shorter than
    `original_max_position / high_freq_factor` are kept, and the band between is interpolated.
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


def _read_rope(fields) -> tuple[float, dict | None]:
    """(theta, Llama 3 scaling or None) of a config.json, its problems recorded."""
    params = fields.get("rope_parameters", None)
    legacy = fields.get("rope_scaling", None)
    if isinstance(params, dict):
        name, scaling = "rope_parameters", params
        theta = params.get("rope_theta", fields.get("rope_theta", _THETA))
    else:
        name, scaling = "rope_scaling", legacy
        theta = fields.get("rope_theta", _THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        fields.problem(f"rope_theta={theta!r} (expected a positive number)")
        theta = 1.0
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        fields.problem(f"{name}={scaling!r} (expected an object)")
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        fields.problem(
            f"{name}.rope_type={kind!r} (supported: 'default' and 'llama3'; linear, dynamic, "
            "yarn and longrope scaling are not)"
        )
        return float(theta), None
    absent = [k for k in _LLAMA3_KEYS if not isinstance(scaling.get(k), (int, float))]
    if absent:
        fields.problem(f"{name} of rope_type 'llama3' lacks {', '.join(absent)}")
        return float(theta), None
    if scaling.get("attention_factor", 1.0) not in (None, 1.0):
        fields.problem(f"{name}.attention_factor={scaling['attention_factor']!r} (only 1.0)")
    return float(theta), {k: scaling[k] for k in _LLAMA3_KEYS}


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

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """theta, Llama 3 scaling and the rotated fraction, from `rope_parameters`
        (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4)."""
        cfg.theta, scaling = _read_rope(fields)
        cfg.interleaved = False  # Hugging Face checkpoints lay q/k out for rotate_half
        params = fields.get("rope_parameters", None)
        partial = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        top = fields.number("partial_rotary_factor", 1.0)  # transformers 4 keeps it here
        cfg.rotary_fraction = float(partial) if partial else top
        cfg.scaling_factor = None
        if scaling is not None:
            cfg.scaling_factor = float(scaling["factor"])
            cfg.low_freq_factor = float(scaling["low_freq_factor"])
            cfg.high_freq_factor = float(scaling["high_freq_factor"])
            cfg.original_max_position = int(scaling["original_max_position_embeddings"])

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        """The RoPE in every form transformers reads (4: rope_theta/rope_scaling, 5:
        rope_parameters), so no stale form survives an export."""
        if cfg.interleaved:
            raise ValueError("interleaved RoPE (Hugging Face rotates halves: interleaved=False)")
        params: dict = {"rope_type": "default", "rope_theta": cfg.theta}
        scaling = None
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

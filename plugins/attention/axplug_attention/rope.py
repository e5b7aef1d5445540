"""Rotary position embedding (RoPE) for the attention `position` slot."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from axplug.config import ConfigError, config_class
from axplug.layers import BaseLayer

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
    # float32 like transformers: the frequencies are compared to 1e-5.
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


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _read_rope(fields) -> tuple[float, dict | None]:
    """(theta, Llama 3 scaling or None) of a config.json, its problems recorded."""
    params = fields.get("rope_parameters", None)
    legacy = fields.get("rope_scaling", None)
    if isinstance(params, dict):
        name, scaling = "rope_parameters", params
        theta = params.get("rope_theta", fields.get("rope_theta", None))
    else:
        name, scaling = "rope_scaling", legacy
        theta = fields.get("rope_theta", None)
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
    if kind == "yarn":
        return float(theta), _read_yarn(fields, name, scaling)
    if kind != "llama3":
        fields.problem(
            f"{name}.rope_type={kind!r} (supported: 'default', 'llama3' and 'yarn'; linear, "
            "dynamic and longrope scaling are not)"
        )
        return float(theta), None
    absent = [k for k in _LLAMA3_KEYS if not isinstance(scaling.get(k), (int, float))]
    if absent:
        fields.problem(f"{name} of rope_type 'llama3' lacks {', '.join(absent)}")
        return float(theta), None
    if scaling.get("attention_factor", 1.0) not in (None, 1.0):
        fields.problem(f"{name}.attention_factor={scaling['attention_factor']!r} (only 1.0)")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_KEYS}}


def _read_yarn(fields, name: str, scaling: dict) -> dict | None:
    """A YaRN scaling's parameters, as transformers reads them (None: its problems recorded)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    absent = [
        k for k in ("factor", "original_max_position_embeddings") if not number(scaling.get(k))
    ]
    if absent:
        fields.problem(
            f"{name} of rope_type 'yarn' lacks {', '.join(absent)} (a factor derived from "
            "max_position_embeddings is not supported)"
        )
        return None
    out: dict = {
        "rope_type": "yarn",
        "factor": float(scaling["factor"]),
        "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        # transformers: `or`, so null and 0 read as the defaults.
        "beta_fast": float(scaling.get("beta_fast") or 32.0),
        "beta_slow": float(scaling.get("beta_slow") or 1.0),
        "truncate": bool(scaling.get("truncate", True)),
    }
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and not number(value):
            fields.problem(f"{name}.{key}={value!r} (expected a number)")
            value = None
        out[key] = None if value is None else float(value)
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
        # Frequency scaling for long context by `scaling_factor`; None disables it.
        # scaling_type "llama3" (Llama 3.1: low/high_freq_factor) or "yarn" (beta_fast/slow,
        # truncate; the rotated dims scaled by `attention_factor`, None: derived from mscale
        # and mscale_all_dim as transformers does).
        scaling_factor: float | None = None
        scaling_type: str = "llama3"
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_position: int = 8192
        beta_fast: float = 32.0
        beta_slow: float = 1.0
        truncate: bool = True
        attention_factor: float | None = None
        mscale: float | None = None
        mscale_all_dim: float | None = None

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """theta, Llama 3 scaling and the rotated fraction, from `rope_parameters`
        (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4)."""
        cfg.theta, scaling = _read_rope(fields)
        cfg.interleaved = False  # Hugging Face checkpoints lay q/k out for rotate_half
        cfg.rotary_fraction = fields.number("partial_rotary_factor", 1.0)
        cfg.scaling_factor = None
        cfg.scaling_type = "llama3"
        if scaling is not None:
            cfg.scaling_type = scaling["rope_type"]
            cfg.scaling_factor = float(scaling["factor"])
            cfg.original_max_position = int(scaling["original_max_position_embeddings"])
        if scaling is not None and scaling["rope_type"] == "llama3":
            cfg.low_freq_factor = float(scaling["low_freq_factor"])
            cfg.high_freq_factor = float(scaling["high_freq_factor"])
        if scaling is not None and scaling["rope_type"] == "yarn":
            for key in ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale",
                        "mscale_all_dim"):  # fmt: skip
                setattr(cfg, key, scaling[key])

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        """The RoPE in every form transformers reads (4: rope_theta/rope_scaling, 5:
        rope_parameters), so no stale form survives an export."""
        if cfg.interleaved:
            raise ValueError("interleaved RoPE (Hugging Face rotates halves: interleaved=False)")
        params: dict = {"rope_type": "default", "rope_theta": cfg.theta}
        scaling = None
        if cfg.scaling_factor is not None and cfg.scaling_type == "yarn":
            scaling = {
                "rope_type": "yarn",
                "factor": cfg.scaling_factor,
                "original_max_position_embeddings": cfg.original_max_position,
                "beta_fast": cfg.beta_fast,
                "beta_slow": cfg.beta_slow,
                "mscale": cfg.mscale,
                "mscale_all_dim": cfg.mscale_all_dim,
            }
            if cfg.attention_factor is not None:
                scaling["attention_factor"] = cfg.attention_factor
            if not cfg.truncate:
                scaling["truncate"] = False
            params = {**scaling, "rope_theta": cfg.theta}
        elif cfg.scaling_factor is not None:
            scaling = {
                "rope_type": "llama3",
                "factor": cfg.scaling_factor,
                "low_freq_factor": cfg.low_freq_factor,
                "high_freq_factor": cfg.high_freq_factor,
                "original_max_position_embeddings": cfg.original_max_position,
            }
            params = {**scaling, "rope_theta": cfg.theta}
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
        if cfg.scaling_type not in ("llama3", "yarn"):
            raise ConfigError(
                f"{self.path}.scaling_type: {cfg.scaling_type!r} is not 'llama3' or 'yarn'"
            )
        llama3 = cfg.scaling_type == "llama3"
        if (
            llama3
            and cfg.scaling_factor is not None
            and cfg.high_freq_factor <= cfg.low_freq_factor
        ):
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
        if cfg.scaling_factor is not None and cfg.scaling_type == "yarn":
            return yarn_frequencies(
                self.rotary_dim(head_dim),
                theta=cfg.theta,
                factor=cfg.scaling_factor,
                original_max_position=cfg.original_max_position,
                beta_fast=cfg.beta_fast,
                beta_slow=cfg.beta_slow,
                truncate=cfg.truncate,
            )
        return rope_frequencies(
            self.rotary_dim(head_dim),
            theta=cfg.theta,
            scaling_factor=cfg.scaling_factor,
            low_freq_factor=cfg.low_freq_factor,
            high_freq_factor=cfg.high_freq_factor,
            original_max_position=cfg.original_max_position,
        )

    def attention_factor(self) -> float:
        """The scale of the rotated dims: YaRN's (1 without it)."""
        cfg = self._config
        if cfg.scaling_factor is None or cfg.scaling_type != "yarn":
            return 1.0
        if cfg.attention_factor is not None:
            return cfg.attention_factor
        if cfg.mscale and cfg.mscale_all_dim:
            return yarn_mscale(cfg.scaling_factor, cfg.mscale) / yarn_mscale(
                cfg.scaling_factor, cfg.mscale_all_dim
            )
        return yarn_mscale(cfg.scaling_factor)

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

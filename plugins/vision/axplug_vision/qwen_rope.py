"""Qwen2-VL's multimodal rotary positions (M-RoPE): a position transform for the language
model's attention, and `rope_index`, the (temporal, height, width) position ids of a prompt
whose images' placeholders lie on their grids."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api.config import ConfigError, config_class
from axplug.api.layers import BaseLayer, side_input

__all__ = ["MultimodalRotaryTransform", "rope_index"]

AXES = 3  # temporal, height, width
_THETA = 1_000_000.0  # transformers' Qwen2_5_VLTextConfig default
_SECTION = (16, 24, 24)  # transformers' default mrope_section


class MultimodalRotaryTransform(BaseLayer):
    """M-RoPE: each head's rotated pairs split in `mrope_section` runs (of head_dim / 2 in
    all), turned by the token's temporal, height and width position id; the ids come as
    `side_input("rope_positions")` [batch, seq, 3] for the tokens fed (q's and k's, the same
    tokens), else every axis takes the token's position (plain RoPE: text only)."""

    @config_class
    class Config(BaseLayer.Config):
        head_dim: int | None = None  # set by Attention
        theta: float = _THETA
        mrope_section: tuple[int, ...] = _SECTION

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        cfg.set(**read_mrope(fields))

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        """The transformers 5 form; a source's older `rope_scaling` cleared, as it would win."""
        section = list(cfg.mrope_section)
        params = {"rope_type": "default", "rope_theta": cfg.theta, "mrope_section": section}
        return {"rope_theta": cfg.theta, "rope_scaling": None, "rope_parameters": params}

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if not _is_section(cfg.mrope_section):
            raise cfg.field_error(
                "mrope_section", f"{cfg.mrope_section!r} is not {AXES} positive ints"
            )
        if cfg.head_dim is not None:
            self._axis_of_pairs(cfg.head_dim)  # fail at build time, not at the first call

    def _axis_of_pairs(self, head_dim: int) -> np.ndarray:
        """[head_dim / 2]: the axis (0 temporal, 1 height, 2 width) each rotated pair turns by."""
        section = self._config.mrope_section
        if 2 * sum(section) != head_dim:
            raise self._config.field_error(
                "mrope_section",
                f"{list(section)} sums to {sum(section)} pairs; head_dim {head_dim} has "
                f"{head_dim // 2}",
            )
        return np.repeat(np.arange(AXES), section)

    def _rotate(self, x: jax.Array, angles: jax.Array) -> jax.Array:
        # x: [b, s, heads, d]; angles: [b, s, d / 2]; pairs are (i, i + d / 2)
        cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
        x32 = x.astype(jnp.float32)
        x1, x2 = jnp.split(x32, 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    def forward(self, q, k, *, q_positions, kv_positions):
        d = q.shape[-1]
        axis = self._axis_of_pairs(d)
        freqs = jnp.asarray(
            (1.0 / self._config.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(
                np.float32
            )
        )
        ids = side_input("rope_positions")
        if ids is None:
            angle = lambda p: p.astype(jnp.float32)[..., None] * freqs  # noqa: E731
            return self._rotate(q, angle(q_positions)), self._rotate(k, angle(kv_positions))
        angles = jnp.asarray(ids)[..., axis].astype(jnp.float32) * freqs
        return self._rotate(q, angles), self._rotate(k, angles)


def read_mrope(fields) -> dict[str, Any]:
    """theta and mrope_section from `rope_parameters` (transformers 5), or `rope_theta` +
    `rope_scaling` ({"type": "mrope", ...}, older configs), which transformers prefers; the
    problems recorded."""
    params, legacy = fields.get("rope_parameters", None), fields.get("rope_scaling", None)
    rope = legacy or params or {}
    if not isinstance(rope, dict):
        fields.problem(f"rope_parameters={rope!r} (expected an object)")
        rope = {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        fields.problem(f"rope_parameters.rope_type={kind!r} (only 'default' or 'mrope')")
    theta = rope.get("rope_theta", fields.number("rope_theta", _THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        fields.problem(f"rope_parameters.rope_theta={theta!r} (expected a positive number)")
        theta = _THETA
    section = rope.get("mrope_section", _SECTION)
    if not _is_section(section):
        fields.problem(f"rope_parameters.mrope_section={section!r} (expected {AXES} positive ints)")
        section = _SECTION
    return {"theta": float(theta), "mrope_section": tuple(section)}


def _is_section(section: Any) -> bool:
    return (
        isinstance(section, (list, tuple))
        and len(section) == AXES
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in section)
    )


def rope_index(input_ids: Any, image_grid_thw: Any, cfg: Any) -> tuple[np.ndarray, int]:
    """(positions [seq, 3] int32, delta) of one prompt, as transformers' `get_rope_index`:
    text tokens count on along all three axes; the k-th image's placeholders
    (`cfg.image_token_id`, t*h*w / merge**2 of them for `image_grid_thw[k]` patches) take
    (t, row, column) of its merged grid after the text before it, which then continues past
    its longer side. `delta` (max + 1 - seq) is what a generated token adds to its index.
    `cfg`: a vision-language model's config (its `image_token_id`, its tower's
    `spatial_merge_size`)."""
    ids = np.asarray(input_ids).reshape(-1)
    merge = cfg.vision.spatial_merge_size
    grids = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    is_image = ids == cfg.image_token_id
    edges = [0, *(np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1).tolist(), len(ids)]
    positions = np.zeros((len(ids), AXES), np.int64)
    start = k = 0
    for begin, end in zip(edges[:-1], edges[1:], strict=True):
        if not is_image[begin]:
            positions[begin:end] = start + np.arange(end - begin)[:, None]
            start += end - begin
            continue
        at = begin
        while at < end:
            if k == len(grids):
                raise ConfigError(
                    f"input_ids: more image placeholders ({int(is_image.sum())}) than the "
                    f"{len(grids)} images of image_grid_thw hold; give one grid per image"
                )
            t, h, w = (int(n) for n in grids[k] // (1, merge, merge))
            if at + t * h * w > end:
                raise ConfigError(
                    f"input_ids: image {k}'s grid {grids[k].tolist()} needs {t * h * w} "
                    f"placeholders, its run has {end - at}; expand each image to its grid"
                )
            positions[at : at + t * h * w] = start + np.indices((t, h, w)).reshape(AXES, -1).T
            at, start, k = at + t * h * w, start + max(h, w), k + 1
    if k != len(grids):
        raise ConfigError(
            f"image_grid_thw: {len(grids)} images, but input_ids' placeholders fill {k}; give "
            "one grid per image in the prompt"
        )
    delta = int(positions.max(initial=-1)) + 1 - len(ids)
    return positions.astype(np.int32), delta

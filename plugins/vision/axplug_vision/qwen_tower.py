"""Qwen2.5-VL's vision tower as a layer: a patch embedding (a stride-sized Conv3d's weight),
bidirectional transformer layers with 2-D (axial) rotary positions and windowed attention (some
layers over the whole image), and a patch merger that folds each spatial_merge_size**2 block
into one token.

Everything that depends on the images' grids is computed in numpy by `qwen_vision_inputs`,
so a jitted `forward` depends only on the total patch count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import (
    HF_ACTIVATIONS,
    Attention,
    BaseLayer,
    FeedForward,
    Linear,
    RMSNorm,
    StackedTransformer,
    TransformerLayer,
    get_activation,
    hf_activation,
)

__all__ = [
    "AxialRotaryPositionTransform",
    "PatchMerger",
    "QwenVisionTower",
    "axial_positions",
    "qwen_vision_inputs",
]

# Attention hands its position transform one int per token, so a token's (row, column) travels
# packed as row << AXIAL_SHIFT | column; the mask ignores positions (not causal, no window).
AXIAL_SHIFT = 16
MAX_GRID_SIDE = (1 << (31 - AXIAL_SHIFT)) - 1  # a packed row stays a positive int32

VISION_MODEL_TYPE = "qwen2_5_vl_vision"
# transformers' Qwen2_5_VLVisionConfig values, for the fields a published vision_config leaves
# out; "qwen2_5_vl" is older checkpoints' model_type for the same tower, the Hub's have none.
_HF_DEFAULTS = dict(
    depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    tokens_per_second=4, window_size=112, out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31],
)  # fmt: skip


def axial_positions(rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Patch (row, column) ids packed into the one int32 position per token Attention takes."""
    return (rows.astype(np.int32) << AXIAL_SHIFT) | columns.astype(np.int32)


class AxialRotaryPositionTransform(BaseLayer):
    """2-D RoPE: the first half of each rotated pair's angles turn with the patch row, the
    second half with its column, at the same frequencies (Qwen2-VL's vision rotary)."""

    @config_class
    class Config(BaseLayer.Config):
        head_dim: int | None = None  # set by Attention
        theta: float = 10000.0

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.head_dim is not None and cfg.head_dim % 4:
            raise cfg.field_error(
                "head_dim", f"{cfg.head_dim} is not a multiple of 4 (2-D rotary pairs per axis)"
            )

    def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        # x: [b, s, heads, d]; positions: [b, s] packed (row, column)
        d = x.shape[-1]
        freqs = 1.0 / self._config.theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))
        rows, columns = positions >> AXIAL_SHIFT, positions & ((1 << AXIAL_SHIFT) - 1)
        angles = jnp.concatenate(
            [rows[..., None] * jnp.asarray(freqs), columns[..., None] * jnp.asarray(freqs)], -1
        )[:, :, None].astype(jnp.float32)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x32 = x.astype(jnp.float32)
        x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    def forward(self, q, k, *, q_positions, kv_positions):
        return self._rotate(q, q_positions), self._rotate(k, kv_positions)


class PatchMerger(BaseLayer):
    """[tokens, input_dim] -> [tokens / merge**2, output_dim]: an RMSNorm, then each run of
    merge**2 tokens concatenated through Linear, GELU, Linear."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        spatial_merge_size: int = 2
        activation: str = "gelu_exact"
        norm: RMSNorm.Config = RMSNorm.default_config().set(eps=1e-6)

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        self._act = get_activation(cfg.activation, f"{self.path}.activation")
        merged = cfg.input_dim * cfg.spatial_merge_size**2
        self._add_child("norm", cfg.norm.clone(input_dim=cfg.input_dim))
        linear = Linear.default_config().set(bias=True)
        self._add_child("hidden", linear.clone(input_dim=merged, output_dim=merged))
        self._add_child("output", linear.clone(input_dim=merged, output_dim=cfg.output_dim))

    def forward(self, x: jax.Array) -> jax.Array:
        unit = self._config.spatial_merge_size**2
        x = self.norm(x)
        return self.output(self._act(self.hidden(x.reshape(x.shape[0] // unit, -1))))


def _layer_config() -> TransformerLayer.Config:
    """A bidirectional layer: RMSNorms, biased q/k/v and output, a biased SwiGLU, 2-D RoPE."""
    attention = Attention.default_config().set(
        causal=False, position=AxialRotaryPositionTransform.default_config()
    )
    attention.qkv.bias = attention.output.bias = True
    feed_forward = FeedForward.default_config().set(gated=True, activation="silu")
    feed_forward.linear.bias = True
    return TransformerLayer.default_config().set(
        attention=attention, feed_forward=feed_forward, norm=RMSNorm.default_config()
    )


class QwenVisionTower(BaseLayer):
    """`forward(patches [num_patches, patch_dim], **qwen_vision_inputs(grid_thw, cfg))` ->
    merged features [num_patches / spatial_merge_size**2, out_dim], in the patches' order.

    Patches are flattened channel, time, row, column (a stride-sized Conv3d's weight order),
    each merge block's patches consecutive, as Qwen2.5-VL's image processor emits them.
    Its Hugging Face fields are a Qwen2.5-VL `vision_config`'s, all read and written here.
    """

    hf_reads_subtree = True
    hf_writes_subtree = True
    hf_defaults = {VISION_MODEL_TYPE: _HF_DEFAULTS, "qwen2_5_vl": _HF_DEFAULTS, None: _HF_DEFAULTS}
    # Its config class's `attribute_map`: the names asked for -> vision_config's.
    hf_aliases = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads"}

    @config_class
    class Config(BaseLayer.Config):
        in_channels: int = 3
        patch_size: Required[int] = REQUIRED
        temporal_patch_size: int = 2
        spatial_merge_size: int = 2
        # Side of an attention window, in pixels (window_size // merge // patch merged tokens).
        window_size: Required[int] = REQUIRED
        dim: Required[int] = REQUIRED
        out_dim: Required[int] = REQUIRED
        # Layers attending over each whole image (frame) rather than within windows.
        full_attention_layers: tuple[int, ...] = ()
        transformer: StackedTransformer.Config = StackedTransformer.default_config().set(
            layer=_layer_config()
        )
        merger: PatchMerger.Config = PatchMerger.default_config()

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        fields.expect("model_type", VISION_MODEL_TYPE, "qwen2_5_vl")
        rope = fields.get("rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            fields.problem(f"rope_parameters.rope_type={rope['rope_type']!r} (only 'axial')")
        act = fields.get("hidden_act")
        if act not in HF_ACTIVATIONS:
            fields.problem(f"hidden_act={act!r} (supported: {', '.join(HF_ACTIVATIONS)})")
        fields.get("tokens_per_second")  # spaces a video's frames: images have one
        # Older checkpoints' names that transformers ignores (in_channels, patch_size rule).
        fields.get("in_chans", None)
        fields.get("spatial_patch_size", None)
        full = fields.get("fullatt_block_indexes")
        if not isinstance(full, (list, tuple)) or not all(isinstance(i, int) for i in full):
            fields.problem(f"fullatt_block_indexes={full!r} (expected a list of layer indices)")
            full = ()
        dim, heads = fields.positive_int("hidden_size"), fields.positive_int("num_attention_heads")
        if heads and dim % heads:
            name = fields.name("num_attention_heads")
            fields.problem(f"hidden_size={dim} is not divisible by {name}={heads}")
        cfg.set(
            in_channels=fields.positive_int("in_channels"),
            patch_size=fields.positive_int("patch_size"),
            temporal_patch_size=fields.positive_int("temporal_patch_size"),
            spatial_merge_size=fields.positive_int("spatial_merge_size"),
            window_size=fields.positive_int("window_size"),
            dim=dim,
            out_dim=fields.positive_int("out_hidden_size"),
            full_attention_layers=tuple(full),
        )
        cfg.transformer.num_layers = fields.positive_int("num_hidden_layers")
        layer = cfg.transformer.layer
        layer.attention.num_heads = heads
        layer.attention.position.theta = float(rope.get("rope_theta", 10000.0))
        layer.feed_forward.hidden_dim = fields.positive_int("intermediate_size")
        layer.feed_forward.activation = HF_ACTIVATIONS.get(act, "silu")

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        """vision_config's fields, by the names `hf_aliases` renames."""
        layer = cfg.transformer.layer
        return {
            "model_type": VISION_MODEL_TYPE,
            "in_channels": cfg.in_channels,
            "patch_size": cfg.patch_size,
            "temporal_patch_size": cfg.temporal_patch_size,
            "spatial_merge_size": cfg.spatial_merge_size,
            "window_size": cfg.window_size,
            "hidden_size": cfg.dim,
            "out_hidden_size": cfg.out_dim,
            "fullatt_block_indexes": list(cfg.full_attention_layers),
            "num_hidden_layers": cfg.transformer.num_layers,
            "num_attention_heads": layer.attention.num_heads,
            "intermediate_size": layer.feed_forward.hidden_dim,
            "hidden_act": hf_activation(layer.feed_forward.activation),
            "rope_parameters": {"rope_type": "axial", "rope_theta": layer.attention.position.theta},
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if _window_tokens(cfg) < 1:
            raise cfg.field_error(
                "window_size",
                f"{cfg.window_size} is smaller than one merged token "
                f"(spatial_merge_size * patch_size = {cfg.spatial_merge_size * cfg.patch_size})",
            )
        layers = cfg.transformer.num_layers
        outside = [i for i in cfg.full_attention_layers if not 0 <= i < layers]
        if outside:
            raise cfg.field_error(
                "full_attention_layers",
                f"{outside} are not among the {layers} layers (0 to {layers - 1})",
            )
        self._add_child("transformer", cfg.transformer.clone(input_dim=cfg.dim))
        self._add_child(
            "merger",
            cfg.merger.clone(
                input_dim=cfg.dim, output_dim=cfg.out_dim, spatial_merge_size=cfg.spatial_merge_size
            ),
        )

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        shape = (cfg.dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # A stride-sized Conv3d's weight, in its own layout (a checkpoint's tensor as it is).
        init = jax.nn.initializers.normal(0.02)
        return {"patch_weight": ParameterSpec(shape, self.dtype, ("embed", *[None] * 4), init)}

    def forward(
        self,
        patches: jax.Array,
        *,
        window_order: jax.Array,
        positions: jax.Array,
        window_segments: jax.Array,
        frame_segments: jax.Array,
        merged_order: jax.Array,
    ) -> jax.Array:
        cfg = self._config
        # Windows made contiguous, as block-sparse attention kernels want them.
        weight = self.parameters["patch_weight"].reshape(cfg.dim, -1)
        x = (patches.astype(self.dtype)[window_order] @ weight.T)[None]
        for i in range(cfg.transformer.num_layers):
            segments = frame_segments if i in cfg.full_attention_layers else window_segments
            layer = getattr(self.transformer, f"layer{i}")
            x = layer(x, positions=positions[None], segment_ids=segments[None])
        return self.merger(x[0])[merged_order]


def _window_tokens(cfg: QwenVisionTower.Config) -> int:
    """The side of an attention window in merged tokens."""
    return cfg.window_size // cfg.spatial_merge_size // cfg.patch_size


def _image_inputs(t: int, h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, ...]:
    """One image's (frames') merged-token window order, window and frame ids in that order
    (numbered from 0), and patch rows and columns in patch order."""
    mh, mw = h // merge, w // merge
    # Each patch's (row, column), merge block by merge block, the same in every frame.
    rows, columns = (
        np.tile(ids.reshape(mh, merge, mw, merge).transpose(0, 2, 1, 3).ravel(), t)
        for ids in np.indices((h, w))
    )
    # Windows of side x side merged tokens, partial at the bottom and right, per frame.
    r, c = np.indices((mh, mw))
    across = -(-mw // side)
    per_frame = -(-mh // side) * across
    window = (
        np.arange(t)[:, None] * per_frame + ((r // side) * across + c // side).ravel()
    ).ravel()
    order = np.argsort(window, kind="stable")
    return order, window[order], order // (mh * mw), rows, columns


def qwen_vision_inputs(grid_thw: np.ndarray, cfg: QwenVisionTower.Config) -> dict[str, np.ndarray]:
    """`forward`'s grid-dependent inputs for images (frames) of `grid_thw` [images, 3] patches:
    the gather into window order (per patch), packed (row, column) positions, window and frame
    segment ids (all in window order), and the gather of merged tokens back to patch order."""
    merge, side = cfg.spatial_merge_size, _window_tokens(cfg)
    parts: list[tuple[np.ndarray, ...]] = []
    units = windows = frames = 0
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        if h % merge or w % merge or min(t, h, w) < 1:
            raise ConfigError(
                f"grid_thw: ({t}, {h}, {w}) patches do not tile into {merge}x{merge} merge "
                "blocks; give positive grids whose height and width are multiples of "
                "spatial_merge_size"
            )
        if max(h, w) > MAX_GRID_SIDE:
            raise ConfigError(
                f"grid_thw: ({t}, {h}, {w}) patches: a side over the {MAX_GRID_SIDE} patches "
                "a packed position holds; resize the image smaller"
            )
        order, window, frame, rows, columns = _image_inputs(t, h, w, merge, side)
        parts.append((units + order, windows + window, frames + frame, rows, columns))
        units += len(order)
        windows, frames = windows + window.max() + 1, frames + t
    merged, window, frame, rows, columns = (np.concatenate(p) for p in zip(*parts, strict=True))
    unit = merge * merge
    patch_order = (merged[:, None] * unit + np.arange(unit)).ravel()
    return {
        "window_order": patch_order.astype(np.int32),
        "positions": axial_positions(rows, columns)[patch_order],
        "window_segments": np.repeat(window, unit).astype(np.int32),
        "frame_segments": np.repeat(frame, unit).astype(np.int32),
        "merged_order": np.argsort(merged).astype(np.int32),
    }

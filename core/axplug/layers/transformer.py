"""Transformer layer: x + attn(norm(x)), then x + ffn(norm(x)); post-norms optional."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from axplug.config import REQUIRED, Required, config_class
from axplug.layers.attention import Attention
from axplug.layers.base import BaseLayer
from axplug.layers.feed_forward import FeedForward
from axplug.layers.norm import RMSNorm
from axplug.module import Module
from axplug.sharding import constrain

__all__ = ["TransformerLayer", "RESIDUAL_AXES"]

RESIDUAL_AXES = ("batch", "seq", "act_embed")  # logical axes of the residual stream


class TransformerLayer(BaseLayer):
    """One decoder block with normed residual branches and optional residual dropout.

    Each branch is `x + post(f(pre(x)))`: `pre_norm` (default) norms the branch input
    (children `attention_norm`, `feed_forward_norm`), `post_norm` its output before the add
    (children `post_attention_norm`, `post_feed_forward_norm`). Both: Gemma 2 and 3; only
    post-norms (`pre_norm=False, post_norm=True`): OLMo 2. Every norm is a copy of `norm`.
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        attention: BaseLayer.Config = Attention.default_config()
        feed_forward: BaseLayer.Config = FeedForward.default_config()
        norm: BaseLayer.Config = RMSNorm.default_config()
        pre_norm: bool = True  # norm each branch's input
        post_norm: bool = False  # norm each branch's output before the residual add
        dropout_rate: float = 0.0

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        dim = cfg.input_dim
        if cfg.pre_norm:
            self._add_child("attention_norm", cfg.norm.clone(input_dim=dim))
        self._add_child("attention", cfg.attention.clone(input_dim=dim))
        if cfg.post_norm:
            self._add_child("post_attention_norm", cfg.norm.clone(input_dim=dim))
        if cfg.pre_norm:
            self._add_child("feed_forward_norm", cfg.norm.clone(input_dim=dim))
        self._add_child("feed_forward", cfg.feed_forward.clone(input_dim=dim))
        if cfg.post_norm:
            self._add_child("post_feed_forward_norm", cfg.norm.clone(input_dim=dim))

    def _dropout(self, x: jax.Array, salt: int) -> jax.Array:
        rate = self._config.dropout_rate
        if not self.is_training or rate == 0.0:
            return x
        keep = jax.random.bernoulli(jax.random.fold_in(self.prng_key, salt), 1.0 - rate, x.shape)
        return jax.numpy.where(keep, x / (1.0 - rate), 0).astype(x.dtype)

    def _pre(self, name: str, x: jax.Array) -> jax.Array:
        return getattr(self, name)(x) if self._config.pre_norm else x

    def _post(self, name: str, h: jax.Array) -> jax.Array:
        return getattr(self, name)(h) if self._config.post_norm else h

    def forward(self, x: jax.Array, *, positions: jax.Array, segment_ids=None) -> jax.Array:
        # Named for remat policies (`offload` moves the layer inputs to host memory).
        x = checkpoint_name(constrain(x, RESIDUAL_AXES), "layer_input")
        h = self.attention(
            self._pre("attention_norm", x), positions=positions, segment_ids=segment_ids
        )
        h = self._post("post_attention_norm", checkpoint_name(h, "attention_output"))
        x = constrain(x + self._dropout(h, 0), RESIDUAL_AXES)
        h = checkpoint_name(
            self.feed_forward(self._pre("feed_forward_norm", x)), "feed_forward_output"
        )
        h = self._post("post_feed_forward_norm", h)
        return constrain(x + self._dropout(h, 1), RESIDUAL_AXES)

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache for `extend_step`."""
        return {"attention": self.attention.init_cache_state(batch_size, max_len)}

    def extend_step(
        self, x: jax.Array, *, positions: jax.Array, cache_state: dict
    ) -> tuple[jax.Array, dict]:
        """`forward` for new tokens that attend to the cached ones; (output, new cache)."""
        h, attention_cache = self.attention.extend_step(
            self._pre("attention_norm", x),
            positions=positions,
            cache_state=cache_state["attention"],
        )
        x = x + self._post("post_attention_norm", h)
        h = self.feed_forward(self._pre("feed_forward_norm", x))
        x = x + self._post("post_feed_forward_norm", h)
        return x, {"attention": attention_cache}

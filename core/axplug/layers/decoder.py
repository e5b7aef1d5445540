"""Decoder (embeddings -> transformer stack -> norm -> logits) and CausalLM (+ loss)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from axplug.api import EMPTY_POSITION
from axplug.config import REQUIRED, Required, config_class
from axplug.context import functional
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Embedding, Linear
from axplug.layers.norm import RMSNorm
from axplug.layers.stack import StackedTransformer
from axplug.layers.transformer import RESIDUAL_AXES
from axplug.module import Module
from axplug.sharding import constrain

__all__ = ["Decoder", "CausalLM", "cross_entropy"]


class Decoder(BaseLayer):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]; `inserted` (mask, embeddings)
    replaces the token embeddings where the mask is set (another modality's, see `_embed`).

    The token embeddings are multiplied by `embedding_scale` (Gemma: sqrt(dim)) when set,
    as a value of the compute dtype; with `position_embedding` (GPT-2's wpe), a learned
    [max_positions, dim] table looked up by position is added to them (child
    `position_embedding`, parameter `weight`; padding's `EMPTY_POSITION` reads row 0, a
    real position past the table NaN). The logits are soft-capped to
    `cap * tanh(logits / cap)` (in float32, then in the logits' dtype) with
    `final_logit_softcap` (Gemma 2), in every path (forward, extend_step, fused_loss).
    """

    @config_class
    class Config(BaseLayer.Config):
        vocab_size: Required[int] = REQUIRED
        dim: Required[int] = REQUIRED
        embedding: Embedding.Config = Embedding.default_config()
        # Multiplies the token embeddings (Gemma: dim ** 0.5); None: no scaling.
        embedding_scale: float | None = None
        # Learned absolute position embeddings added to the token embeddings (GPT-2), and the
        # number of positions they cover; None: none (positions only reach the attention).
        position_embedding: Embedding.Config | None = None
        max_positions: int | None = None
        transformer: BaseLayer.Config = StackedTransformer.default_config()
        output_norm: BaseLayer.Config = RMSNorm.default_config()
        lm_head: Linear.Config = Linear.default_config().set(mesh_axes=("embed", "vocab"))
        tie_word_embeddings: bool = False
        # Logits become cap * tanh(logits / cap) (Gemma 2: 30.0); None: not capped.
        final_logit_softcap: float | None = None

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """Vocabulary, width and head tying from a Hugging Face config.json."""
        cfg.vocab_size = fields.positive_int("vocab_size")
        cfg.dim = fields.positive_int("hidden_size")
        cfg.tie_word_embeddings = bool(fields.get("tie_word_embeddings", False))

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        }

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        scale = cfg.embedding_scale
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise cfg.field_error("embedding_scale", f"{scale} must be a finite number > 0")
        cap = cfg.final_logit_softcap
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise cfg.field_error("final_logit_softcap", f"{cap} must be a finite number > 0")
        if cfg.position_embedding is None:
            if cfg.max_positions is not None:
                raise cfg.field_error(
                    "max_positions", "is read only with position_embedding; set that too"
                )
        elif cfg.max_positions is None or cfg.max_positions < 1:
            raise cfg.field_error(
                "max_positions",
                f"{cfg.max_positions}: position_embedding needs the number of positions "
                "(>= 1) its table covers",
            )
        self._add_child(
            "embedding", cfg.embedding.clone(num_embeddings=cfg.vocab_size, dim=cfg.dim)
        )
        if cfg.position_embedding is not None:
            self._add_child(
                "position_embedding",
                cfg.position_embedding.clone(num_embeddings=cfg.max_positions, dim=cfg.dim),
            )
        self._add_child("transformer", cfg.transformer.clone(input_dim=cfg.dim))
        self._add_child("output_norm", cfg.output_norm.clone(input_dim=cfg.dim))
        if not cfg.tie_word_embeddings:
            self._add_child(
                "lm_head", cfg.lm_head.clone(input_dim=cfg.dim, output_dim=cfg.vocab_size)
            )

    def forward(
        self, input_ids: jax.Array, *, positions=None, segment_ids=None, inserted=None
    ) -> jax.Array:
        x = self.hidden_states(
            input_ids, positions=positions, segment_ids=segment_ids, inserted=inserted
        )
        return constrain(self._logits(x), ("batch", "seq", "vocab"))

    def hidden_states(
        self, input_ids: jax.Array, *, positions=None, segment_ids=None, inserted=None
    ) -> jax.Array:
        """The stack's output [batch, seq, dim], before the output norm and the head."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        positions = constrain(positions, ("batch", "seq"))
        if segment_ids is not None:
            segment_ids = constrain(segment_ids, ("batch", "seq"))
        x = constrain(self._embed(input_ids, positions, inserted), RESIDUAL_AXES)
        return self.transformer(x, positions=positions, segment_ids=segment_ids)

    def embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The transformer's input [batch, seq, dim] for token ids at `positions`."""
        return self._embed(input_ids, positions)

    def project(self, x: jax.Array) -> jax.Array:
        """Logits of hidden states through the head alone (no output norm; soft-capped)."""
        tied = self._config.tie_word_embeddings
        logits = self.embedding.attend(x) if tied else self.lm_head(x)
        cap = self._config.final_logit_softcap
        if cap is None:
            return logits
        capped = cap * jnp.tanh(logits.astype(jnp.float32) / cap)
        return capped.astype(logits.dtype)

    @property
    def fuses_loss(self) -> bool:
        """Whether the stack computes the loss itself when training (a 1F1B pipeline)."""
        return self.transformer.fuses_loss

    def fused_loss(
        self,
        input_ids: jax.Array,
        labels: jax.Array,
        *,
        positions=None,
        segment_ids=None,
        inserted=None,
    ) -> tuple[jax.Array, jax.Array]:
        """(mean cross entropy, label count) with the head inside the stack's schedule."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        positions = constrain(positions, ("batch", "seq"))
        if segment_ids is not None:
            segment_ids = constrain(segment_ids, ("batch", "seq"))
        labels = constrain(labels, ("batch", "seq"))
        x = constrain(self._embed(input_ids, positions, inserted), RESIDUAL_AXES)
        used = ("output_norm", "embedding" if self._config.tie_word_embeddings else "lm_head")
        head_params = {name: self.parameters[name] for name in used}

        def head(params, h, labels):
            logits, _ = functional(
                self, prng_key=None, state=params, inputs=(h,), is_training=True, method="_logits"
            )
            return cross_entropy_sum(logits, labels)

        total = self.transformer.forward_with_loss(
            x,
            head=head,
            head_params=head_params,
            labels=labels,
            positions=positions,
            segment_ids=segment_ids,
        )
        count = jnp.sum(labels >= 0)
        return total / jnp.maximum(count, 1), count

    def _embed(self, input_ids: jax.Array, positions: jax.Array, inserted=None) -> jax.Array:
        """The transformer's input [batch, seq, dim] for token ids at `positions`, with
        `inserted` = (mask [batch, seq], embeddings [batch, seq, dim]) in place of the token
        embeddings where the mask is set (an image's features at its placeholder tokens)."""
        cfg = self._config
        x = self.embedding(input_ids)
        if cfg.embedding_scale is not None:
            # In the compute dtype, as Hugging Face's Gemma: hidden * tensor(scale, hidden.dtype).
            x = x * jnp.asarray(cfg.embedding_scale, x.dtype)
        if inserted is not None:  # after the scale: inserted embeddings are not scaled
            x = jnp.where(inserted[0][..., None], inserted[1].astype(x.dtype), x)
        if cfg.position_embedding is not None:
            # Padding (EMPTY_POSITION, in extend_step) reads row 0; its outputs are never used.
            x = x + self.position_embedding(jnp.where(positions == EMPTY_POSITION, 0, positions))
        return x

    def _logits(self, x: jax.Array) -> jax.Array:
        return self.project(self.output_norm(x))

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache for `extend_step`: `max_len` tokens per row."""
        return {"transformer": self.transformer.init_cache_state(batch_size, max_len)}

    def extend_step(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array,
        cache_state: dict,
        logits_at: jax.Array | None = None,
        inserted=None,
    ) -> tuple[jax.Array, dict]:
        """(logits [batch, new, vocab], new cache) for new tokens after the cached ones;
        with `logits_at` [batch] only that token's logits, [batch, 1, vocab] (a prefill needs
        the last prompt token's alone).

        Positions of padding tokens are `EMPTY_POSITION` (see `axplug.layers.kv_cache`);
        `inserted` as in `forward`.
        """
        x = self._embed(input_ids, positions, inserted)
        x, cache = self.transformer.extend_step(
            x, positions=positions, cache_state=cache_state["transformer"]
        )
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        return self._logits(x), {"transformer": cache}


def cross_entropy_sum(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Summed token cross entropy in float32 over labels >= 0."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(labels >= 0, log_z - label_logit, 0.0))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean token cross entropy in float32 over labels >= 0, and the count of those labels."""
    count = jnp.sum(labels >= 0)
    return cross_entropy_sum(logits, labels) / jnp.maximum(count, 1), count


class CausalLM(BaseLayer):
    """A decoder trained with next-token cross entropy; labels < 0 are ignored."""

    hf_role = "causal_lm"  # a subclass that trains more beside it (MTP) exports as one

    @config_class
    class Config(BaseLayer.Config):
        decoder: Decoder.Config = Decoder.default_config()

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        self._add_child("decoder", cfg.decoder)

    @classmethod
    def folded_config(cls, cfg: Config) -> Config:
        """A subclass (another loss over the same parameters: DPO, RL) folds to this class."""
        return cfg if cls is CausalLM else CausalLM.default_config().set(decoder=cfg.decoder)

    def predict(self, input_ids: jax.Array, *, positions=None, segment_ids=None) -> jax.Array:
        """Logits [batch, seq, vocab]."""
        return self.decoder(input_ids, positions=positions, segment_ids=segment_ids)

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache for `extend_step`."""
        return self.decoder.init_cache_state(batch_size, max_len)

    def extend_step(
        self, input_ids: jax.Array, *, positions: jax.Array, cache_state: dict, logits_at=None
    ):
        """(logits, new cache) for new tokens after the cached ones (see Decoder.extend_step)."""
        return self.decoder.extend_step(
            input_ids, positions=positions, cache_state=cache_state, logits_at=logits_at
        )

    def forward(self, input_ids, target_labels, *, positions=None, segment_ids=None):
        """(loss, {"logits", "num_tokens"}) for next-token targets aligned with the inputs;
        no logits where the stack computes the loss itself (a 1F1B pipeline in training)."""
        if self.is_training and self.decoder.fuses_loss:
            logits = None
            loss, count = self.decoder.fused_loss(
                input_ids, target_labels, positions=positions, segment_ids=segment_ids
            )
        else:
            logits = self.decoder(input_ids, positions=positions, segment_ids=segment_ids)
            loss, count = cross_entropy(logits, constrain(target_labels, ("batch", "seq")))
        self.add_summary("loss", loss)
        return loss, {"logits": logits, "num_tokens": count}

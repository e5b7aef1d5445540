"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values from one low-rank latent
per token, RoPE on a narrow slice of q and k, and a decode cache of that latent.

A whole attention layer for the `attention` slot of `TransformerLayer` (in place of the
core's `Attention`), with its own `forward`, `init_cache_state` and `extend_step`:

    q = q_proj(x)                       or   q_b_proj(q_a_norm(q_a_proj(x)))   (q_lora_rank)
    q -> per head [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]
    kv_a_proj(x) -> [latent (kv_lora_rank) | k_rope (qk_rope_head_dim, one head for all)]
    latent = kv_a_norm(latent);  kv_b_proj(latent) -> per head [k_nope | v (v_head_dim)]
    q_rope, k_rope = RoPE(q_rope), RoPE(k_rope)     (the `position` slot)
    out = output(softmax([q_nope, q_rope] . [k_nope, k_rope] * scale) v)

The decode cache holds what MLA was made for: per token the normed latent and the rotated
k_rope (kv_lora_rank + qk_rope_head_dim numbers, whatever the heads), not the expanded k/v.
It is the `kv_cache` slot's state (contiguous or paged) with one kv head, whose `key` holds
the latent and whose `value` holds k_rope. `extend_step` attends in the latent space, the
up-projection absorbed: scores = (q_nope W_uk) . latent + q_rope . k_rope, output =
(softmax . latent) W_uv; the same numbers as `forward`, another order of sums.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from axplug.api import AttentionMask
from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import BaseLayer, ContiguousKVCache, DotProductKernel, Linear, RMSNorm
from axplug.api.sharding import constrain
from axplug_attention.rope import RotaryPositionTransform, yarn_mscale

__all__ = ["MultiHeadLatentAttention"]

_Q_AXES = ("batch", "seq", "heads", None)  # [batch, seq, heads, head_dim]
_KV_AXES = ("batch", "kv_seq", "heads", None)
_LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek latent norms: RMSNorm(rank), its default eps


class MultiHeadLatentAttention(BaseLayer):
    """MLA as one attention layer: forward, and decoding through a latent cache."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        q_lora_rank: int | None = None  # None: q_proj straight from the input
        kv_lora_rank: Required[int] = REQUIRED
        qk_nope_head_dim: Required[int] = REQUIRED
        qk_rope_head_dim: Required[int] = REQUIRED
        v_head_dim: Required[int] = REQUIRED
        # RoPE pairs (2i, 2i + 1) of the rope dims (DeepSeek's layout); False: (i, i + d/2).
        # Set on the `position` slot when it has an `interleaved` field.
        rope_interleave: bool = True
        # A bias on q_a_proj, kv_a_proj and output (Hugging Face's `attention_bias`).
        bias: bool = False
        latent_norm_eps: float = _LATENT_NORM_EPS
        # The softmax scale; None: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times
        # yarn_mscale(yarn_factor, yarn_mscale_all_dim) ** 2 when the position slot is a YaRN
        # RoPE with yarn_mscale_all_dim (DeepSeek's long-context temperature).
        softmax_scale: float | None = None
        position: BaseLayer.Config = RotaryPositionTransform.default_config()
        kernel: BaseLayer.Config = DotProductKernel.default_config()
        linear: Linear.Config = Linear.default_config()  # template of the projections
        output: Linear.Config = Linear.default_config().set(mesh_axes=("heads", "embed"))
        # Used only by init_cache_state / extend_step (decoding), never by forward.
        kv_cache: BaseLayer.Config = ContiguousKVCache.default_config()

    @classmethod
    def hf_read(cls, cfg: Any, fields) -> None:
        """The MLA fields of a DeepSeek-V3 config.json."""
        heads = fields.positive_int("num_attention_heads")
        cfg.num_heads = heads
        kv_heads = fields.get("num_key_value_heads", heads)
        if kv_heads != heads:
            fields.problem(
                f"num_key_value_heads={kv_heads!r} differs from num_attention_heads={heads!r} "
                "(MLA expands the latent into one key and value per query head)"
            )
        rank = fields.get("q_lora_rank", None)
        cfg.q_lora_rank = None if rank is None else fields.positive_int("q_lora_rank")
        cfg.kv_lora_rank = fields.positive_int("kv_lora_rank")
        cfg.qk_nope_head_dim = fields.positive_int("qk_nope_head_dim")
        cfg.qk_rope_head_dim = fields.positive_int("qk_rope_head_dim")
        cfg.v_head_dim = fields.positive_int("v_head_dim")
        # transformers derives both: head_dim (the RoPE width) and qk_head_dim.
        for name, want in (
            ("head_dim", cfg.qk_rope_head_dim),
            ("qk_head_dim", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
        ):
            got = fields.get(name, want)
            if got != want:
                fields.problem(f"{name}={got!r} (MLA implies {want})")
        cfg.rope_interleave = bool(fields.get("rope_interleave", True))
        cfg.bias = bool(fields.get("attention_bias", False))
        fields.expect("attention_dropout", 0.0, 0)
        cfg.latent_norm_eps = _LATENT_NORM_EPS
        cfg.softmax_scale = None

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        if cfg.latent_norm_eps != _LATENT_NORM_EPS:
            raise ValueError(
                f"latent_norm_eps={cfg.latent_norm_eps} (Hugging Face's MLA norms have "
                f"{_LATENT_NORM_EPS})"
            )
        if cfg.softmax_scale is not None:
            raise ValueError(
                f"softmax_scale={cfg.softmax_scale} (Hugging Face derives the scale from the "
                "head widths and the YaRN RoPE scaling)"
            )
        return {
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_heads,
            "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "head_dim": cfg.qk_rope_head_dim,
            "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            "rope_interleave": bool(cfg.rope_interleave),
            "attention_bias": bool(cfg.bias),
            "attention_dropout": 0.0,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        for name in (
            "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        ):  # fmt: skip
            if getattr(cfg, name) < 1:
                raise ConfigError(f"{self.path}.{name}: {getattr(cfg, name)} must be >= 1")
        if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
            raise ConfigError(f"{self.path}.q_lora_rank: {cfg.q_lora_rank} must be >= 1 or None")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(
                f"{self.path}.qk_rope_head_dim: {cfg.qk_rope_head_dim} must be even (RoPE pairs)"
            )
        h, dim = cfg.num_heads, cfg.input_dim
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

        def linear(name, n_in, n_out, axes, bias=False):
            self._add_child(
                name, cfg.linear.clone(input_dim=n_in, output_dim=n_out, mesh_axes=axes, bias=bias)
            )

        def norm(name, width):
            self._add_child(
                name, RMSNorm.default_config().set(input_dim=width, eps=cfg.latent_norm_eps)
            )

        if cfg.q_lora_rank is None:
            linear("q_proj", dim, h * qk, ("embed", "heads"))
        else:
            linear("q_a_proj", dim, cfg.q_lora_rank, ("embed", None), cfg.bias)
            norm("q_a_norm", cfg.q_lora_rank)
            linear("q_b_proj", cfg.q_lora_rank, h * qk, (None, "heads"))
        linear("kv_a_proj", dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, ("embed", None), cfg.bias)
        norm("kv_a_norm", cfg.kv_lora_rank)
        linear("kv_b_proj", cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
               (None, "heads"))  # fmt: skip
        position = cfg.position.clone()
        if hasattr(position, "head_dim"):
            position.head_dim = cfg.qk_rope_head_dim
        if hasattr(position, "interleaved"):
            position.interleaved = cfg.rope_interleave
        self._add_child("position", position)
        kernel = cfg.kernel.clone()
        if not hasattr(kernel, "scale"):
            raise ConfigError(
                f"{self.path}.kernel: MLA sets the softmax scale of its kernel slot, and "
                f"{getattr(kernel.klass, '__name__', kernel)} has no `scale` field"
            )
        if kernel.scale is None:
            kernel.scale = self.softmax_scale
        self._add_child("kernel", kernel)
        self._add_child(
            "output", cfg.output.clone(input_dim=h * cfg.v_head_dim, output_dim=dim, bias=cfg.bias)
        )
        self._add_child("kv_cache", cfg.kv_cache)

    @property
    def softmax_scale(self) -> float:
        cfg = self._config
        if cfg.softmax_scale is not None:
            return cfg.softmax_scale
        scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        factor = getattr(cfg.position, "yarn_factor", None)
        mscale_all_dim = getattr(cfg.position, "yarn_mscale_all_dim", None)
        if factor is not None and mscale_all_dim:
            scale *= yarn_mscale(factor, mscale_all_dim) ** 2
        return scale

    # -- the projections -----------------------------------------------------------------

    def _queries(self, x):
        """(q_nope [b, s, h, dn], q_rope [b, s, h, dr] rotated)."""
        cfg = self._config
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(*q.shape[:-1], cfg.num_heads, -1)
        return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]

    def _latents(self, x):
        """(normed latent [b, s, r], k_rope [b, s, 1, dr] not yet rotated)."""
        r = self._config.kv_lora_rank
        kv = self.kv_a_proj(x)
        return self.kv_a_norm(kv[..., :r]), kv[..., None, r:]

    def _project(self, x, positions):
        q_nope, q_rope = self._queries(x)
        latent, k_rope = self._latents(x)
        q_rope, k_rope = self.position(
            q_rope, k_rope, q_positions=positions, kv_positions=positions
        )
        return q_nope, q_rope, latent, k_rope

    def forward(self, x: jax.Array, *, positions: jax.Array, segment_ids=None) -> jax.Array:
        # x: [batch, seq, dim]; positions: [batch, seq]
        cfg = self._config
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        kv = self.kv_b_proj(latent)
        kv = kv.reshape(*kv.shape[:-1], cfg.num_heads, -1)
        k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim :]
        k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], cfg.qk_rope_head_dim))
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), _Q_AXES)
        k, v = constrain(k, _KV_AXES), constrain(v, _KV_AXES)
        gathered = lambda a: None if a is None else constrain(a, ("batch", "kv_seq"))  # noqa: E731
        mask = AttentionMask(
            q_positions=positions,
            kv_positions=constrain(positions, ("batch", "kv_seq")),
            q_segment_ids=segment_ids,
            kv_segment_ids=gathered(segment_ids),
            causal=True,
        )
        out = constrain(self.kernel(q, k, v, mask), _Q_AXES)
        return self.output(out.reshape(*out.shape[:2], -1))

    # -- decoding ------------------------------------------------------------------------

    def init_cache_state(self, batch_size: int, max_len: int, dtype=None) -> dict:
        """An empty latent cache: the kv_cache slot's state with one kv head, `key` the
        normed latent [.., kv_lora_rank] and `value` the rotated k_rope [.., qk_rope_head_dim]."""
        cfg = self._config
        dtype = dtype or self.compute_dtype
        state = self.kv_cache.init_state(
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=1,
            head_dim=cfg.kv_lora_rank,
            dtype=dtype,
        )
        value = state["value"]
        state["value"] = jnp.zeros((*value.shape[:-1], cfg.qk_rope_head_dim), dtype)
        return state

    def extend_step(
        self, x: jax.Array, *, positions: jax.Array, cache_state: dict
    ) -> tuple[jax.Array, dict]:
        """(output, new cache state) for new tokens `x` attending to the cache and themselves,
        in the latent space (kv_b_proj absorbed into q and the output); equals `forward`
        over the whole sequence."""
        cfg = self._config
        dn = cfg.qk_nope_head_dim
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        cache_state, latent_all, k_rope_all, kv_positions = self.kv_cache.extend(
            cache_state, latent[:, :, None], k_rope, positions
        )  # latent_all [b, t, 1, r], k_rope_all [b, t, 1, dr]
        w = self.cast(self.parameters["kv_b_proj"]["weight"])
        w = w.reshape(cfg.kv_lora_rank, cfg.num_heads, dn + cfg.v_head_dim)
        w_uk, w_uv = w[..., :dn], w[..., dn:]  # [r, h, dn], [r, h, dv]
        q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)
        q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
        k = jnp.concatenate([latent_all, k_rope_all.astype(latent_all.dtype)], axis=-1)
        mask = AttentionMask(q_positions=positions, kv_positions=kv_positions, causal=True)
        out = self.kernel(q, k, latent_all, mask)  # [b, s, h, r]: MQA over the latents
        out = jnp.einsum("bshr,rhv->bshv", out, w_uv)
        return self.output(out.reshape(*out.shape[:2], -1)), cache_state

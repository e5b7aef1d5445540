"""Multi-head attention whose projection, position transform and kernel are child slots."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from axplug.api import AttentionMask, linear_bias
from axplug.config import REQUIRED, ConfigError, Required, config_class
from axplug.context import side_input
from axplug.kernels import reference_attention, select_paged_kernel
from axplug.layers.base import BaseLayer
from axplug.layers.basic import Linear
from axplug.layers.kv_cache import ContiguousKVCache, KVCache
from axplug.module import Module
from axplug.sharding import constrain

__all__ = [
    "AttentionMask",
    "linear_bias",
    "QKVLinear",
    "IdentityPositionTransform",
    "AttentionKernelSlot",
    "DotProductKernel",
    "Attention",
    "QK_NORM_OVER",
]

_Q_AXES = ("batch", "seq", "heads", None)  # [batch, seq, heads, head_dim]
_KV_AXES = ("batch", "kv_seq", "heads", None)


class QKVLinear(BaseLayer):
    """Projects [batch, seq, dim] to q [b, s, heads, d] and k, v [b, s, kv_heads, d].

    `bias=True` gives the q, k and v projections a bias each (Qwen2); the attention's output
    projection is configured apart (`Attention.output`) and keeps none unless it says so.
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        head_dim: Required[int] = REQUIRED
        # Biases on the q, k, v projections (parameters q.bias, k.bias, v.bias); the same as
        # linear.bias=True, which also adds them.
        bias: bool = False
        linear: Linear.Config = Linear.default_config().set(mesh_axes=("embed", "heads"))

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """q/k/v biases (`qkv_bias`, else `attention_bias`); as many k/v heads as query heads
        (GQA is a plugin's layer)."""
        cfg.bias = bool(fields.get("qkv_bias", fields.get("attention_bias", False)))
        cfg.linear.bias = False  # `bias` says it (one field, so export compares one)
        heads = fields.get("num_attention_heads", None)
        kv_heads = fields.get("num_key_value_heads", heads)
        if kv_heads != heads:
            fields.problem(
                f"num_key_value_heads={kv_heads!r} differs from num_attention_heads={heads!r}: "
                "grouped-query attention needs a plugin's QKV layer (`axplug list --kind layers`)"
            )

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        return {"qkv_bias": bool(cfg.bias or cfg.linear.bias)}

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_heads

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        linear = cfg.linear.clone(bias=True) if cfg.bias else cfg.linear
        for name, heads in (
            ("q", cfg.num_heads),
            ("k", self.num_kv_heads),
            ("v", self.num_kv_heads),
        ):
            self._add_child(
                name, linear.clone(input_dim=cfg.input_dim, output_dim=heads * cfg.head_dim)
            )

    def forward(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        d = self._config.head_dim
        split = lambda t: t.reshape(*t.shape[:-1], -1, d)  # noqa: E731
        return split(self.q(x)), split(self.k(x)), split(self.v(x))


class IdentityPositionTransform(BaseLayer):
    """No positional transform of q and k (the slot RoPE fills)."""

    @config_class
    class Config(BaseLayer.Config):
        head_dim: int | None = None

    def forward(self, q, k, *, q_positions, kv_positions):
        del q_positions, kv_positions
        return q, k


class AttentionKernelSlot(BaseLayer):
    """Base of attention's kernel slot: `forward(q [b, sq, h, d], k [b, skv, kvh, d], v,
    mask)` -> [b, sq, h, d] in v's dtype, h % kvh == 0, the mask an `AttentionMask`; and
    `paged_attention`, a decode step over a paged cache (by default through paged dispatch)."""

    @config_class
    class Config(BaseLayer.Config):
        scale: float | None = None  # None: 1/sqrt(head_dim)

    def paged_attention(self, q, paged, *, logit_softcap: float | None = None) -> jax.Array:
        """A decode step's q [b, h, d] over a paged cache's pages in place (`PagedKV`)."""
        return paged_attention(q, paged, scale=self._config.scale, logit_softcap=logit_softcap)


class DotProductKernel(AttentionKernelSlot):
    """softmax(softcap(q k^T * scale) + bias, masked) v in float32; k/v may have fewer heads
    (grouped); the cap is the mask's `logit_softcap` (none by default)."""

    @config_class
    class Config(AttentionKernelSlot.Config):
        pass

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        # q: [b, sq, h, d]; k, v: [b, skv, kvh, d] -> [b, sq, h, d]
        h, kvh = q.shape[2], k.shape[2]
        if h % kvh:
            raise ConfigError(f"{self.path}: {h} query heads not divisible by {kvh} kv heads")
        d = q.shape[-1]
        scale = self._config.scale if self._config.scale is not None else 1.0 / math.sqrt(d)
        return reference_attention(
            q, k, v, mask.dense(), scale=scale, bias=mask.bias(), logit_softcap=mask.logit_softcap
        )


def paged_attention(
    q,
    paged,
    *,
    scale: float | None,
    backend: str | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """q [b, h, d] over `paged` with the paged kernel dispatch picks (plugin API 1.3); with
    `logit_softcap`, one that soft-caps the scores."""
    _, kernel = select_paged_kernel(q, paged, backend=backend, logit_softcap=logit_softcap)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if logit_softcap is None:
        return kernel(q, paged, scale=scale)
    return kernel(q, paged, scale=scale, logit_softcap=logit_softcap)


QK_NORM_OVER = ("head_dim", "projection")


class Attention(BaseLayer):
    """Self-attention: qkv slot -> q/k norms (optional) -> position slot -> kernel slot ->
    output projection.

    `qk_norm` (a norm config, e.g. `RMSNorm.default_config()`) normalizes q and k after
    the projection and before the position transform (RoPE), as children `q_norm` and
    `k_norm`: over each head's `head_dim` with one scale shared by the heads
    (`qk_norm_over="head_dim"`: Qwen3, Gemma 3), or over the whole q projection
    (num_heads * head_dim) and k projection (num_kv_heads * head_dim) before the split into
    heads (`"projection"`: OLMo 2).

    `logit_softcap` soft-caps the scaled scores to `cap * tanh(s / cap)` before the mask
    (Gemma 2); it reaches the kernel slot on the mask (`AttentionMask.logit_softcap`), so
    dispatch picks only kernels that cap. The scores' scale is the kernel slot's `scale`
    (Gemma: `query_pre_attn_scalar ** -0.5`; None: `head_dim ** -0.5`).
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_heads: Required[int] = REQUIRED
        head_dim: int | None = None  # None: input_dim // num_heads
        causal: bool = True
        sliding_window: int | None = None
        # Per-head slopes of a linear distance bias on the scores (ALiBi, set by a plugin's
        # modifier); None: no bias. Plugin API 1.1.
        linear_bias_slopes: tuple[float, ...] | None = None
        # A norm (any layer config with `input_dim`) of q and of k; None: none.
        qk_norm: BaseLayer.Config | None = None
        # What qk_norm normalizes over: "head_dim" (per head) or "projection" (all heads).
        qk_norm_over: str = "head_dim"
        # Soft cap of the attention scores, cap * tanh(s / cap) (Gemma 2: 50.0); None: none.
        logit_softcap: float | None = None
        qkv: BaseLayer.Config = QKVLinear.default_config()
        position: BaseLayer.Config = IdentityPositionTransform.default_config()
        kernel: BaseLayer.Config = DotProductKernel.default_config()
        output: Linear.Config = Linear.default_config().set(mesh_axes=("heads", "embed"))
        # Used only by init_cache_state / extend_step (decoding), never by forward.
        kv_cache: BaseLayer.Config = ContiguousKVCache.default_config()

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        """Heads, head width and the sliding window from a Hugging Face config.json.

        `layer_types` is one attention for every layer here, unless a parent already read it:
        a stack with a per-layer pattern, whose kinds then set each layer's window over the
        one read into this (its layer template's) config."""
        heads = fields.positive_int("num_attention_heads")
        cfg.num_heads = heads
        head_dim = fields.get("head_dim", None)
        if head_dim is None:
            dim = fields.positive_int("hidden_size")
            if heads and dim % heads:
                fields.problem(
                    f"hidden_size={dim} is not divisible by num_attention_heads={heads}; "
                    "set head_dim"
                )
            cfg.head_dim = dim // heads if heads else None
        else:
            cfg.head_dim = fields.positive_int("head_dim")
        fields.expect("attention_dropout", 0.0, 0)
        cfg.output.bias = bool(fields.get("attention_bias", False))
        cfg.sliding_window = None
        if fields.get("use_sliding_window", True) is False:
            fields.get("sliding_window", None)  # set, but switched off
            fields.get("max_window_layers", None)
        else:
            window = fields.get("sliding_window", None)
            cfg.sliding_window = None if window is None else fields.positive_int("sliding_window")
        # Read already: a parent (a stack with a per-layer pattern) sets each layer's window.
        kinds = set()
        if fields.name("layer_types") not in fields.read:
            kinds = set(fields.get("layer_types", None) or ())
        if kinds == {"full_attention"}:
            cfg.sliding_window = None
        elif kinds - {"sliding_attention"}:
            fields.problem(
                f"layer_types mixes {sorted(kinds)}: one attention for every layer here (a "
                "per-layer pattern needs an architecture that builds one)"
            )

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        if not cfg.causal:
            raise ValueError("attention is not causal (a causal LM's is)")
        if cfg.linear_bias_slopes is not None:
            raise ValueError("attention has an ALiBi bias, which no supported architecture has")
        # No head_dim: Hugging Face's default, hidden_size // num_attention_heads.
        width = {"head_dim": cfg.head_dim} if cfg.head_dim else {}
        return {
            **width,
            "num_attention_heads": cfg.num_heads,
            "attention_dropout": 0.0,
            "attention_bias": bool(cfg.output.bias),
            "sliding_window": cfg.sliding_window,
        }

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        for slot, base in (
            ("qkv", QKVLinear),
            ("kernel", AttentionKernelSlot),
            ("kv_cache", KVCache),
        ):
            klass = getattr(cfg, slot).klass
            if not (isinstance(klass, type) and issubclass(klass, base)):
                raise cfg.field_error(slot, f"{klass!r} must derive from {base.__qualname__}")
        head_dim = cfg.head_dim or cfg.input_dim // cfg.num_heads
        self._head_dim = head_dim
        self._add_child(
            "qkv",
            cfg.qkv.clone(input_dim=cfg.input_dim, num_heads=cfg.num_heads, head_dim=head_dim),
        )
        if cfg.qk_norm is not None:
            self._add_qk_norms(cfg, head_dim)
        position = cfg.position.clone()
        if hasattr(position, "head_dim"):
            position.head_dim = head_dim
        self._add_child("position", position)
        self._add_child("kernel", cfg.kernel)
        self._add_child(
            "output", cfg.output.clone(input_dim=cfg.num_heads * head_dim, output_dim=cfg.input_dim)
        )
        self._add_child("kv_cache", cfg.kv_cache)
        cap = cfg.logit_softcap
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise cfg.field_error("logit_softcap", f"{cap} must be a finite number > 0")
        slopes = cfg.linear_bias_slopes
        if slopes is not None and len(slopes) != cfg.num_heads:
            raise cfg.field_error(
                "linear_bias_slopes",
                f"{len(slopes)} slopes for {cfg.num_heads} heads; give one per query head",
            )

    def _add_qk_norms(self, cfg: Config, head_dim: int) -> None:
        if cfg.qk_norm_over not in QK_NORM_OVER:
            raise cfg.field_error(
                "qk_norm_over",
                f"{cfg.qk_norm_over!r} is not one of {', '.join(map(repr, QK_NORM_OVER))}",
            )
        if not hasattr(cfg.qk_norm, "input_dim"):
            raise cfg.field_error(
                "qk_norm",
                f"{type(cfg.qk_norm).__qualname__} has no input_dim field; give a norm such "
                "as RMSNorm.default_config()",
            )
        kv_heads = self.qkv.num_kv_heads
        per_head = cfg.qk_norm_over == "head_dim"
        for name, heads in (("q_norm", cfg.num_heads), ("k_norm", kv_heads)):
            dim = head_dim if per_head else heads * head_dim
            self._add_child(name, cfg.qk_norm.clone(input_dim=dim))

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [b, s, h, d], k, v [b, s, kvh, d] from the qkv slot, q and k normed if asked."""
        q, k, v = self.qkv(x)
        if self._config.qk_norm is None:
            return q, k, v
        if self._config.qk_norm_over == "head_dim":
            return self.q_norm(q), self.k_norm(k), v
        # Over the whole projection, as before the split into heads.
        whole = lambda norm, t: norm(t.reshape(*t.shape[:-2], -1)).reshape(t.shape)  # noqa: E731
        return whole(self.q_norm, q), whole(self.k_norm, k), v

    def _slopes(self) -> jax.Array | None:
        slopes = self._config.linear_bias_slopes
        return None if slopes is None else jnp.asarray(slopes, jnp.float32)

    def make_mask(self, positions, segment_ids=None) -> AttentionMask:
        """The self-attention mask; its key side is gathered along the sequence like k, v.
        A caller's `side_inputs(causal_limits=[batch, seq])` moves each query's causal limit
        (an image's tokens see the whole image: `AttentionMask.q_causal_limits`)."""
        gathered = lambda a: None if a is None else constrain(a, ("batch", "kv_seq"))  # noqa: E731
        return AttentionMask(
            q_positions=positions,
            kv_positions=gathered(positions),
            q_segment_ids=segment_ids,
            kv_segment_ids=gathered(segment_ids),
            causal=self._config.causal,
            sliding_window=self._config.sliding_window,
            linear_bias_slopes=self._slopes(),
            logit_softcap=self._config.logit_softcap,
            q_causal_limits=side_input("causal_limits"),
        )

    def forward(self, x: jax.Array, *, positions: jax.Array, segment_ids=None) -> jax.Array:
        # x: [batch, seq, dim]; positions: [batch, seq]
        q, k, v = self._project(x)
        q, k = self.position(q, k, q_positions=positions, kv_positions=positions)
        # Queries keep their sequence shard; keys and values are gathered along the sequence,
        # so attention under sequence parallelism is exact (each shard sees every key).
        q = constrain(q, _Q_AXES)
        k, v = constrain(k, _KV_AXES), constrain(v, _KV_AXES)
        out = constrain(self.kernel(q, k, v, self.make_mask(positions, segment_ids)), _Q_AXES)
        return self.output(out.reshape(*out.shape[:2], -1))

    def init_cache_state(self, batch_size: int, max_len: int, dtype=None) -> dict:
        """An empty KV cache for `extend_step` (dtype: the compute dtype unless given)."""
        return self.kv_cache.init_state(
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=self.qkv.num_kv_heads,
            head_dim=self._head_dim,
            dtype=dtype or self.compute_dtype,
        )

    def extend_step(
        self, x: jax.Array, *, positions: jax.Array, cache_state: dict
    ) -> tuple[jax.Array, dict]:
        """(output, new cache state) for new tokens `x` attending to the cache and themselves.

        Prefill is one call with the whole prompt on an empty cache; decoding then calls it
        with one token at a time. Outputs equal `forward` over the whole sequence.
        """
        if not self._config.causal:
            raise ConfigError(f"{self.path}: decoding with a KV cache needs causal attention")
        # x: [batch, new, dim]; positions: [batch, new]
        q, k, v = self._project(x)
        q, k = self.position(q, k, q_positions=positions, kv_positions=positions)
        cfg = self._config
        if (
            q.shape[1] == 1  # a decode step: one query per row, every cached token visible
            and cfg.sliding_window is None
            and cfg.linear_bias_slopes is None
        ):
            cache_state, paged = self.kv_cache.extend_paged(cache_state, k, v, positions)
            out = self.kernel.paged_attention(q[:, 0], paged, logit_softcap=cfg.logit_softcap)
            out = out[:, None]  # the pages read in place
            return self.output(out.reshape(*out.shape[:2], -1)), cache_state
        cache_state, k_all, v_all, kv_positions = self.kv_cache.extend(cache_state, k, v, positions)
        mask = AttentionMask(
            q_positions=positions,
            kv_positions=kv_positions,
            causal=True,
            sliding_window=self._config.sliding_window,
            linear_bias_slopes=self._slopes(),
            logit_softcap=self._config.logit_softcap,
            q_causal_limits=side_input("causal_limits"),
        )
        out = self.kernel(q, k_all, v_all, mask)
        return self.output(out.reshape(*out.shape[:2], -1)), cache_state

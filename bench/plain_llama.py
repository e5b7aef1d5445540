"""The same decoder-only LM and AdamW step as an axplug preset, in plain JAX + optax.

The reference side of `step_time.py`: parameters are a plain pytree, the model is a few
functions, and one `jax.jit` with `donate_argnums` runs the step. `spec_from_config` reads the
shapes and hyperparameters from an axplug Trainer config and refuses features this file does
not implement, so the two sides can only ever compute the same math.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "ModelSpec",
    "spec_from_config",
    "from_axplug_params",
    "make_optimizer",
    "make_train_step",
]

NEG_INF = -1e30
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    vocab: int
    dim: int
    layers: int
    heads: int
    hidden: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    gated: bool
    activation: str
    rope_theta: float | None  # None: no position transform
    tie_embeddings: bool


def _cls(cfg: Any) -> str:
    return getattr(getattr(cfg, "klass", None), "__name__", type(cfg).__qualname__)


def spec_from_config(cfg: Any) -> ModelSpec:
    """The ModelSpec of a Trainer config; ValueError names any feature not reproduced here."""
    unsupported = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            unsupported.append(what)

    model = cfg.model
    dec = model.decoder
    need(_cls(model) == "CausalLM", f"model {_cls(model)}")
    need(model.compute_dtype in (None, "float32"), f"compute_dtype={model.compute_dtype}")
    need(model.dtype in (None, "float32"), f"dtype={model.dtype}")
    need(_cls(dec.transformer) == "StackedTransformer", f"transformer {_cls(dec.transformer)}")
    layer = dec.transformer.layer
    attn, ffn, norm = layer.attention, layer.feed_forward, layer.norm
    need(layer.dropout_rate == 0.0, "dropout")
    need(_cls(attn.qkv) == "QKVLinear", f"qkv {_cls(attn.qkv)} (e.g. GQA)")
    need(_cls(attn.kernel) == "DotProductKernel", f"kernel {_cls(attn.kernel)}")
    need(attn.kernel.scale is None, "custom attention scale")
    need(attn.causal and attn.sliding_window is None, "non-causal or sliding-window attention")
    need(attn.head_dim in (None, dec.dim // attn.num_heads), "custom head_dim")
    rope_theta = None
    if _cls(attn.position) == "RotaryPositionTransform":
        pos = attn.position
        need(pos.rotary_fraction == 1.0, "partial rotary")
        need(not pos.interleaved, "interleaved RoPE")
        need(pos.scaling_factor is None, "RoPE frequency scaling")
        rope_theta = float(pos.theta)
    else:
        need(_cls(attn.position) == "IdentityPositionTransform", f"position {_cls(attn.position)}")
    need(_cls(ffn) == "FeedForward", f"feed_forward {_cls(ffn)}")
    need(ffn.activation in ACTIVATIONS, f"activation {ffn.activation}")
    need(_cls(norm) in ("RMSNorm", "LayerNorm"), f"norm {_cls(norm)}")
    need(_cls(dec.output_norm) == _cls(norm), "output_norm differs from the layer norm")
    if _cls(norm) == "LayerNorm":
        need(norm.bias, "LayerNorm without bias")
    for linear in (attn.qkv.linear, attn.output, ffn.linear, dec.lm_head):
        need(not linear.bias, "Linear with bias")
    if unsupported:
        raise ValueError(
            "bench/plain_llama.py does not implement: " + ", ".join(unsupported) + "; pick a "
            "preset with unrolled float32 MHA layers (llama-tiny, gpt-tiny)"
        )
    return ModelSpec(
        vocab=dec.vocab_size,
        dim=dec.dim,
        layers=dec.transformer.num_layers,
        heads=attn.num_heads,
        hidden=ffn.hidden_dim,
        norm="rms" if _cls(norm) == "RMSNorm" else "layer",
        norm_eps=float(norm.eps),
        gated=ffn.gated,
        activation=ffn.activation,
        rope_theta=rope_theta,
        tie_embeddings=dec.tie_word_embeddings,
    )


# --- parameters -----------------------------------------------------------------------------


def _norm_params(p: dict) -> dict:
    return {"scale": p["scale"], **({"bias": p["bias"]} if "bias" in p else {})}


def from_axplug_params(tree: dict, spec: ModelSpec) -> dict:
    """axplug's nested module tree -> this file's layout (same leaves, renamed)."""
    dec = tree["decoder"]
    layers = []
    for i in range(spec.layers):
        src = dec["transformer"][f"layer{i}"]
        attn, ffn = src["attention"], src["feed_forward"]
        layer = {
            "attn_norm": _norm_params(src["attention_norm"]),
            "wq": attn["qkv"]["q"]["weight"],
            "wk": attn["qkv"]["k"]["weight"],
            "wv": attn["qkv"]["v"]["weight"],
            "wo": attn["output"]["weight"],
            "mlp_norm": _norm_params(src["feed_forward_norm"]),
            "w_up": ffn["wi_up"]["weight"],
            "w_down": ffn["wo"]["weight"],
        }
        if spec.gated:
            layer["w_gate"] = ffn["wi_gate"]["weight"]
        layers.append(layer)
    params = {
        "embed": dec["embedding"]["weight"],
        "layers": layers,
        "final_norm": _norm_params(dec["output_norm"]),
    }
    if not spec.tie_embeddings:
        params["lm_head"] = dec["lm_head"]["weight"]
    return params


def decay_mask(params: dict) -> dict:
    """Weight decay on matrices (embeddings included), not on norm scales and biases."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


# --- model ----------------------------------------------------------------------------------


def _norm(x, p, spec: ModelSpec):
    x = x.astype(jnp.float32)
    if spec.norm == "rms":
        ms = jnp.mean(x * x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(ms + spec.norm_eps) * p["scale"]
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + spec.norm_eps) * p["scale"] + p["bias"]


def _rope_tables(seq: int, head_dim: int, theta: float):
    # Pairs (i, i + head_dim/2), the Hugging Face Llama layout.
    freqs = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(
        np.float32
    )
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs  # [s, d/2]
    return jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]  # [1, s, 1, d/2]


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(p, x, spec: ModelSpec, rope, mask):
    b, s, _ = x.shape
    hd = spec.dim // spec.heads
    q, k, v = (
        jnp.einsum("bsd,de->bse", x, p[w]).reshape(b, s, spec.heads, hd)  # [b, s, h, hd]
        for w in ("wq", "wk", "wv")
    )
    if rope is not None:
        q, k = _rope(q, *rope), _rope(k, *rope)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hd))
    probs = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, spec.dim)
    return jnp.einsum("bse,ed->bsd", out, p["wo"])


def _mlp(p, x, spec: ModelSpec):
    act = ACTIVATIONS[spec.activation]
    up = jnp.einsum("bsd,dh->bsh", x, p["w_up"])
    h = act(jnp.einsum("bsd,dh->bsh", x, p["w_gate"])) * up if spec.gated else act(up)
    return jnp.einsum("bsh,hd->bsd", h, p["w_down"])


def logits_fn(params, input_ids, spec: ModelSpec):
    """[batch, seq] token ids -> [batch, seq, vocab] logits."""
    seq = input_ids.shape[1]
    rope = _rope_tables(seq, spec.dim // spec.heads, spec.rope_theta) if spec.rope_theta else None
    mask = jnp.tril(jnp.ones((seq, seq), bool))  # [q, k]: causal
    x = jnp.take(params["embed"], input_ids, axis=0)  # [b, s, d]
    for p in params["layers"]:
        x = x + _attention(p, _norm(x, p["attn_norm"], spec), spec, rope, mask)
        x = x + _mlp(p, _norm(x, p["mlp_norm"], spec), spec)
    x = _norm(x, params["final_norm"], spec)
    head = params["embed"].T if spec.tie_embeddings else params["lm_head"]
    return jnp.einsum("bsd,dv->bsv", x, head)


def loss_fn(params, batch, spec: ModelSpec):
    """Mean next-token cross entropy over labels >= 0."""
    logits = logits_fn(params, batch["input_ids"], spec).astype(jnp.float32)
    labels = batch["target_labels"]
    valid = labels >= 0
    nll = (
        jax.nn.logsumexp(logits, axis=-1)
        - jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    )
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


# --- optimizer and step ---------------------------------------------------------------------


def make_schedule(learner: Any, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine/linear/constant decay to end_fraction * peak."""
    peak = learner.learning_rate
    decay_steps = max((learner.decay_steps or total_steps) - learner.warmup_steps, 1)
    end = peak * learner.end_learning_rate_fraction
    if learner.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak if peak else 0)
    elif learner.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if not learner.warmup_steps:
        return after
    warmup = optax.linear_schedule(0.0, peak, learner.warmup_steps)
    return optax.join_schedules([warmup, after], [learner.warmup_steps])


def make_optimizer(learner: Any, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping then masked AdamW, from an axplug Learner config."""
    if learner.optimizer != "adamw" or learner.grad_accumulation_steps != 1:
        raise ValueError("bench/plain_llama.py implements AdamW without grad accumulation only")
    opt = optax.adamw(
        make_schedule(learner, total_steps),
        b1=learner.b1,
        b2=learner.b2,
        eps=learner.eps,
        weight_decay=learner.weight_decay,
        mask=decay_mask,
    )
    if learner.max_grad_norm is None:
        return opt
    return optax.chain(optax.clip_by_global_norm(learner.max_grad_norm), opt)


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation):
    """A fresh `step(params, opt_state, batch) -> (params, opt_state, loss)` (not jitted)."""
    grad_fn = jax.value_and_grad(loss_fn)

    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch, spec)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step

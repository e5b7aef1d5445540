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
    "cross_entropy",
    "capacity",
    "rope_tables",
    "apply_rope",
    "moe_ffn",
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
    compute_dtype: str = "float32"  # parameters stay float32; cast where used
    # "xla": einsums and a softmax; "flash": jax.nn.dot_product_attention (cuDNN on a GPU).
    attention: str = "xla"
    # Mixture of experts in every layer's feed-forward (experts = 0: dense).
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: drop-free
    renormalize: bool = True
    load_balance_coefficient: float = 0.0
    z_loss_coefficient: float = 0.0


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
    dtypes = (None, "float32", "bfloat16")
    need(model.compute_dtype in dtypes, f"compute_dtype={model.compute_dtype}")
    need(model.dtype in (None, "float32"), f"dtype={model.dtype}")
    need(_cls(dec.transformer) == "StackedTransformer", f"transformer {_cls(dec.transformer)}")
    layer = dec.transformer.layer
    if _cls(layer) != "TransformerLayer":
        raise ValueError(
            f"bench/plain_llama.py does not implement: layer {_cls(layer)} (e.g. MoE every N)"
        )
    attn, ffn, norm = layer.attention, layer.feed_forward, layer.norm
    need(layer.dropout_rate == 0.0, "dropout")
    need(_cls(attn.qkv) == "QKVLinear", f"qkv {_cls(attn.qkv)} (e.g. GQA)")
    kernel = _cls(attn.kernel)
    need(kernel in ("DotProductKernel", "FlashAttention"), f"kernel {kernel}")
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
    need(_cls(ffn) in ("FeedForward", "MoEFeedForward"), f"feed_forward {_cls(ffn)}")
    need(ffn.activation in ACTIVATIONS, f"activation {ffn.activation}")
    moe = {}
    if _cls(ffn) == "MoEFeedForward":
        router = ffn.router
        need(ffn.num_shared_experts == 0, "shared experts")
        need(_cls(router) == "TopKRouter", f"router {_cls(router)}")
        need(ffn.compute_dtype in (None, model.compute_dtype), "MoE compute_dtype override")
        moe = dict(
            experts=ffn.num_experts,
            top_k=router.top_k,
            capacity_factor=router.capacity_factor,
            renormalize=router.renormalize,
            load_balance_coefficient=float(router.load_balance_coefficient),
            z_loss_coefficient=float(router.z_loss_coefficient),
        )
    need(_cls(norm) in ("RMSNorm", "LayerNorm"), f"norm {_cls(norm)}")
    need(_cls(dec.output_norm) == _cls(norm), "output_norm differs from the layer norm")
    if _cls(norm) == "LayerNorm":
        need(norm.bias, "LayerNorm without bias")
    linears = (attn.qkv.linear, attn.output, dec.lm_head) + (() if moe else (ffn.linear,))
    for linear in linears:
        need(not linear.bias, "Linear with bias")
    if unsupported:
        raise ValueError(
            "bench/plain_llama.py does not implement: " + ", ".join(unsupported) + "; pick a "
            "preset with unrolled float32 MHA layers (llama-tiny, gpt-tiny, moe-tiny)"
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
        compute_dtype=model.compute_dtype or "float32",
        attention="flash" if kernel == "FlashAttention" else "xla",
        **moe,
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
        }
        if spec.experts:  # MoE: [experts, ...] weights are plain arrays, the router a Linear
            layer["router"] = ffn["router"]["weight"]
            layer["w_up"], layer["w_down"] = ffn["wi_up"], ffn["wo"]
            if spec.gated:
                layer["w_gate"] = ffn["wi_gate"]
        else:
            layer["w_up"], layer["w_down"] = ffn["wi_up"]["weight"], ffn["wo"]["weight"]
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


def _c(x, spec: ModelSpec):
    return x.astype(spec.compute_dtype)


def _norm(x, p, spec: ModelSpec):
    # float32 whatever the compute dtype, as the axplug norms.
    x = x.astype(jnp.float32)
    if spec.norm == "rms":
        ms = jnp.mean(x * x, axis=-1, keepdims=True)
        return _c(x * jax.lax.rsqrt(ms + spec.norm_eps) * p["scale"], spec)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return _c((x - mean) * jax.lax.rsqrt(var + spec.norm_eps) * p["scale"] + p["bias"], spec)


def rope_tables(seq: int, head_dim: int, theta: float):
    # Pairs (i, i + head_dim/2), the Hugging Face Llama layout.
    freqs = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(
        np.float32
    )
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs  # [s, d/2]
    return jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]  # [1, s, 1, d/2]


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention(p, x, spec: ModelSpec, rope, mask):
    b, s, _ = x.shape
    hd = spec.dim // spec.heads
    q, k, v = (
        jnp.einsum("bsd,de->bse", x, _c(p[w], spec)).reshape(b, s, spec.heads, hd)
        for w in ("wq", "wk", "wv")
    )  # [b, s, h, hd]
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if spec.attention == "flash":
        cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn" if cudnn else "xla"
        )
        return jnp.einsum("bse,ed->bsd", out.reshape(b, s, spec.dim), _c(p["wo"], spec))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask, logits * (1.0 / math.sqrt(hd)), NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, spec.dim)
    return jnp.einsum("bse,ed->bsd", out, _c(p["wo"], spec))


def _mlp(p, x, spec: ModelSpec):
    return _ffn(p, x, spec, "bsd,dh->bsh", "bsh,hd->bsd")


def _ffn(p, x, spec: ModelSpec, eq_in: str, eq_out: str):
    act = ACTIVATIONS[spec.activation]
    up = jnp.einsum(eq_in, x, _c(p["w_up"], spec))
    h = act(jnp.einsum(eq_in, x, _c(p["w_gate"], spec))) * up if spec.gated else act(up)
    return jnp.einsum(eq_out, h, _c(p["w_down"], spec))


def capacity(group_size: int, spec: ModelSpec) -> int:
    """Slots per expert in a group of `group_size` tokens (GShard; None factor: drop-free)."""
    if spec.capacity_factor is None:
        return group_size
    slots = math.ceil(spec.capacity_factor * group_size * spec.top_k / spec.experts)
    return max(1, min(group_size, slots))


def moe_ffn(p, x, spec: ModelSpec):
    """Top-k token choice over `experts` SwiGLU experts, one routing group per sequence.

    Choices claim expert slots first choices first, in token order; choices past an expert's
    capacity are dropped. Experts run on [expert, group, slot] buffers filled by gathers.
    Returns (output, load-balance loss + router z-loss, both scaled by their coefficients).
    """
    g, s, d = x.shape
    e, k = spec.experts, spec.top_k
    logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32), p["router"])  # routing in f32
    probs = jax.nn.softmax(logits, axis=-1)
    gates, index = jax.lax.top_k(probs, k)  # [g, s, k]
    if spec.renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    c = capacity(s, spec)
    choice = jax.nn.one_hot(index, e, dtype=jnp.int32)  # [g, s, k, e]
    ordered = choice.transpose(0, 2, 1, 3).reshape(g, k * s, e)  # first choices first
    position = jnp.sum((jnp.cumsum(ordered, axis=1) - 1) * ordered, axis=-1)
    position = position.reshape(g, k, s).transpose(0, 2, 1)  # [g, s, k]
    kept = position < c
    weights = jnp.where(kept, gates, 0.0)

    load = jnp.mean(jnp.sum(choice, axis=2), axis=(0, 1)) / k  # [e]
    balance = e * jnp.sum(jax.lax.stop_gradient(load) * jnp.mean(probs, axis=(0, 1)))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    aux = spec.load_balance_coefficient * balance + spec.z_loss_coefficient * z

    # slot[g, s*k]: flat expert slot of each choice, e*c (a spare, zero slot) when dropped.
    slot = jnp.where(kept, index * c + position, e * c).reshape(g, s * k)
    token = jnp.broadcast_to(jnp.arange(s * k, dtype=jnp.int32) // k, (g, s * k))
    token_of_slot = jnp.full((g, e * c + 1), s, jnp.int32)
    token_of_slot = token_of_slot.at[jnp.arange(g)[:, None], slot].set(token)
    padded = jnp.concatenate([x, jnp.zeros((g, 1, d), x.dtype)], axis=1)
    buf = jnp.take_along_axis(padded, token_of_slot[:, : e * c, None], axis=1)
    buf = buf.reshape(g, e, c, d).transpose(1, 0, 2, 3)  # [e, g, c, d]
    out = _ffn(p, buf, spec, "egcd,edh->egch", "egch,ehd->egcd").transpose(1, 0, 2, 3)
    out = jnp.concatenate([out.reshape(g, e * c, d), jnp.zeros((g, 1, d), x.dtype)], axis=1)
    y = jnp.take_along_axis(out, slot[:, :, None], axis=1).reshape(g, s, k, d)
    return jnp.einsum("gskd,gsk->gsd", y, weights.astype(y.dtype)), aux


def logits_fn(params, input_ids, spec: ModelSpec):
    """[batch, seq] token ids -> ([batch, seq, vocab] logits, summed aux losses)."""
    seq = input_ids.shape[1]
    rope = rope_tables(seq, spec.dim // spec.heads, spec.rope_theta) if spec.rope_theta else None
    mask = jnp.tril(jnp.ones((seq, seq), bool))  # [q, k]: causal
    x = jnp.take(_c(params["embed"], spec), input_ids, axis=0)  # [b, s, d]
    aux = jnp.zeros((), jnp.float32)
    for p in params["layers"]:
        x = x + _attention(p, _norm(x, p["attn_norm"], spec), spec, rope, mask)
        h = _norm(x, p["mlp_norm"], spec)
        if spec.experts:
            h, layer_aux = moe_ffn(p, h, spec)
            aux = aux + layer_aux
        else:
            h = _mlp(p, h, spec)
        x = x + h.astype(x.dtype)
    x = _norm(x, params["final_norm"], spec)
    head = params["embed"].T if spec.tie_embeddings else params["lm_head"]
    return jnp.einsum("bsd,dv->bsv", x, _c(head, spec)), aux


def loss_fn(params, batch, spec: ModelSpec):
    """Mean next-token cross entropy over labels >= 0, plus the MoE aux losses."""
    logits, aux = logits_fn(params, batch["input_ids"], spec)
    return cross_entropy(logits, batch["target_labels"]) + aux


def cross_entropy(logits, labels):
    """Mean next-token cross entropy in float32 over labels >= 0."""
    logits = logits.astype(jnp.float32)
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

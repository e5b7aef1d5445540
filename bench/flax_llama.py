"""The same decoder-only LM as `plain_llama.py`, written as Flax NNX modules.

The third side of `step_time.py`. Projections, embeddings and norms are `nnx.Linear`,
`nnx.Embed` and `nnx.RMSNorm`/`nnx.LayerNorm`; the shapes and hyperparameters come from the
same `plain_llama.ModelSpec`. The step uses the functional NNX pattern the Flax docs give for
speed: `nnx.split` once, `nnx.merge` inside one `jax.jit` with donation, optax on the
parameter `nnx.State` (the same optimizer as the plain side). RoPE tables and the MoE routing
arithmetic are the plain side's functions, so only the model structure is Flax's.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
import plain_llama
from flax import nnx
from plain_llama import ACTIVATIONS, NEG_INF, ModelSpec

__all__ = ["Model", "abstract_split", "from_plain_params", "make_train_step"]


def _linear(din: int, dout: int, spec: ModelSpec, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, dtype=spec.compute_dtype, rngs=rngs)


def _norm(spec: ModelSpec, rngs: nnx.Rngs) -> nnx.Module:
    if spec.norm == "rms":
        return nnx.RMSNorm(spec.dim, epsilon=spec.norm_eps, use_fast_variance=False, rngs=rngs)
    return nnx.LayerNorm(spec.dim, epsilon=spec.norm_eps, use_fast_variance=False, rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head self-attention with optional RoPE; softmax in float32."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.spec = spec
        self.wq, self.wk, self.wv, self.wo = (
            _linear(spec.dim, spec.dim, spec, rngs) for _ in range(4)
        )

    def __call__(self, x, rope, mask):
        b, s, _ = x.shape
        heads = self.spec.heads
        hd = self.spec.dim // heads
        q, k, v = (w(x).reshape(b, s, heads, hd) for w in (self.wq, self.wk, self.wv))
        if rope is not None:
            q, k = plain_llama.apply_rope(q, *rope), plain_llama.apply_rope(k, *rope)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = jnp.where(mask, logits * (1.0 / math.sqrt(hd)), NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return self.wo(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1))


class MLP(nnx.Module):
    """Dense feed-forward, gated (SwiGLU) or not."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.act = ACTIVATIONS[spec.activation]
        self.w_up = _linear(spec.dim, spec.hidden, spec, rngs)
        self.w_gate = _linear(spec.dim, spec.hidden, spec, rngs) if spec.gated else None
        self.w_down = _linear(spec.hidden, spec.dim, spec, rngs)

    def __call__(self, x):
        up = self.w_up(x)
        h = self.act(self.w_gate(x)) * up if self.w_gate is not None else self.act(up)
        return self.w_down(h), jnp.zeros((), jnp.float32)


class MoE(nnx.Module):
    """`experts` feed-forwards as [expert, ...] parameters behind a float32 top-k router."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.spec = spec
        e, d, h = spec.experts, spec.dim, spec.hidden
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)  # float32 routing
        self.w_up = nnx.Param(init(rngs.params(), (e, d, h)))
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, h))) if spec.gated else None
        self.w_down = nnx.Param(init(rngs.params(), (e, h, d)))

    def __call__(self, x):
        p = {"router": self.router.kernel[...], "w_up": self.w_up[...], "w_down": self.w_down[...]}
        if self.w_gate is not None:
            p["w_gate"] = self.w_gate[...]
        return plain_llama.moe_ffn(p, x, self.spec)


class Block(nnx.Module):
    """Pre-norm transformer layer: attention then feed-forward, each residual."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.dtype = spec.compute_dtype
        self.attn_norm = _norm(spec, rngs)
        self.attn = Attention(spec, rngs)
        self.mlp_norm = _norm(spec, rngs)
        self.mlp = MoE(spec, rngs) if spec.experts else MLP(spec, rngs)

    def __call__(self, x, rope, mask):
        # Norms in float32, as the other sides, then the compute dtype.
        x = x + self.attn(self.attn_norm(x.astype(jnp.float32)).astype(self.dtype), rope, mask)
        h, aux = self.mlp(self.mlp_norm(x.astype(jnp.float32)).astype(self.dtype))
        return x + h.astype(x.dtype), aux


class Model(nnx.Module):
    """Token ids [batch, seq] -> (logits [batch, seq, vocab], summed MoE aux losses)."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
        self.spec = spec
        self.embed = nnx.Embed(spec.vocab, spec.dim, dtype=spec.compute_dtype, rngs=rngs)
        self.layers = nnx.List([Block(spec, rngs) for _ in range(spec.layers)])
        self.final_norm = _norm(spec, rngs)
        self.lm_head = None if spec.tie_embeddings else _linear(spec.dim, spec.vocab, spec, rngs)

    def __call__(self, input_ids):
        spec = self.spec
        seq = input_ids.shape[1]
        rope = None
        if spec.rope_theta:
            rope = plain_llama.rope_tables(seq, spec.dim // spec.heads, spec.rope_theta)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        x = self.embed(input_ids)
        aux = jnp.zeros((), jnp.float32)
        for block in self.layers:
            x, layer_aux = block(x, rope, mask)
            aux = aux + layer_aux
        x = self.final_norm(x.astype(jnp.float32)).astype(spec.compute_dtype)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits, aux


def abstract_split(spec: ModelSpec) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract parameter state) of the model, without allocating it."""
    return nnx.split(nnx.eval_shape(lambda: Model(spec, nnx.Rngs(0))))


def from_plain_params(params: dict, spec: ModelSpec) -> dict:
    """`plain_llama` layout -> the pure-dict form of this model's state (same arrays)."""

    def norm(p):
        return dict(p)

    def linear(w):
        return {"kernel": w}

    layers = {}
    for i, p in enumerate(params["layers"]):
        attn = {n: linear(p[n]) for n in ("wq", "wk", "wv", "wo")}
        if spec.experts:
            mlp = {"router": linear(p["router"]), "w_up": p["w_up"], "w_down": p["w_down"]}
            if spec.gated:
                mlp["w_gate"] = p["w_gate"]
        else:
            mlp = {n: linear(p[n]) for n in ("w_up", "w_down", "w_gate") if n in p}
        layers[i] = {
            "attn_norm": norm(p["attn_norm"]),
            "attn": attn,
            "mlp_norm": norm(p["mlp_norm"]),
            "mlp": mlp,
        }
    tree = {
        "embed": {"embedding": params["embed"]},
        "layers": layers,
        "final_norm": norm(params["final_norm"]),
    }
    if not spec.tie_embeddings:
        tree["lm_head"] = linear(params["lm_head"])
    return tree


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """A fresh `step(state, opt_state, batch) -> (state, opt_state, loss)` (not jitted)."""

    def loss_fn(state: nnx.State, batch: dict[str, Any]) -> jax.Array:
        logits, aux = nnx.merge(graphdef, state)(batch["input_ids"])
        return plain_llama.cross_entropy(logits, batch["target_labels"]) + aux

    grad_fn = jax.value_and_grad(loss_fn)

    def step(state, opt_state, batch):
        loss, grads = grad_fn(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    return step

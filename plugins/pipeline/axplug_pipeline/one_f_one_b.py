"""The 1F1B pipeline schedule: each stage alternates one forward and one backward microbatch,
so at most 2S - 1 microbatches are in flight per stage, whatever the number of microbatches.

Autodiff of a scanned pipeline runs every forward before any backward and keeps what every
microbatch's forward saved. Here the schedule computes the loss and its gradients itself, in
one scan of M + 2S - 1 ticks; `jax.custom_vjp` hands them to the caller's autodiff. At tick
t stage s runs the backward pass of microbatch t - 2S + 1 + s (recomputing its forward from
the stage input it stashed) and the forward pass of microbatch t - s; the last stage's output
goes through the loss head at once, whose gradient starts that microbatch's backward pass at
the next tick. Every tick runs both passes on every stage (masked where idle), so the idle
share is (2S - 1) / (M + 2S - 1) of the ticks, and each stage keeps min(M, 2S - 1) stage
inputs rather than M microbatches' activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from axplug.api.layers import RESIDUAL_AXES
from axplug.api.sharding import constrain

__all__ = ["one_f_one_b", "masked"]

STAGE = "stage"


def one_f_one_b(
    stage: Callable,
    head: Callable,
    *,
    params: Any,
    head_params: Any,
    xs: jax.Array,
    labels: jax.Array,
    extras: dict,
    whole: Callable,
) -> jax.Array:
    """Sum over microbatches of `head(head_params, stages(xs[m]), labels[m])`.

    `stage(params, h, micro, extras)`: every stage at once, h [S, mb, ...] -> [S, mb, ...],
    stage s on microbatch micro[s]. `xs` [M, mb, ...] are the microbatched inputs, `labels`
    and each of `extras` [M, ...] per microbatch. Differentiable in params, head_params, xs.
    """
    run = functools.partial(_schedule, stage, head, whole)
    return _fused(run, params, head_params, xs, labels, extras)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(run, params, head_params, xs, labels, extras):
    return run(params, head_params, xs, labels, extras)[0]


def _fused_fwd(run, params, head_params, xs, labels, extras):
    loss, grads = run(params, head_params, xs, labels, extras)
    return loss, grads


def _fused_bwd(run, grads, g):
    scaled = jax.tree.map(lambda a: (a * g).astype(a.dtype), grads)
    return (*scaled, None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _schedule(stage, head, whole, params, head_params, xs, labels, extras):
    """(loss sum, (d params, d head_params, d xs)) by the 1F1B schedule."""
    M = xs.shape[0]
    S = jax.tree.leaves(params)[0].shape[0]
    K = min(M, 2 * S - 1)  # stash slots per stage: microbatches in flight
    stage_ids = jnp.arange(S)

    def at(v, micro):  # per-stage rows of a per-microbatch array
        return jnp.take(v, micro, axis=0)

    def on_stages(a):
        return constrain(a, (STAGE, *RESIDUAL_AXES))

    def tick(carry, t):
        fwd_out, bwd_out, head_grad, stash, g_params, g_head, dxs, loss = carry

        # Backward: stage s on microbatch t - 2S + 1 + s, from its stashed input; the
        # cotangent is stage s + 1's input gradient (the last stage's: the head's).
        b = t - 2 * S + 1 + stage_ids
        valid_b = (b >= 0) & (b < M)
        bc = jnp.clip(b, 0, M - 1)
        g_in = on_stages(jnp.concatenate([bwd_out[1:], head_grad[None]], axis=0))
        h_b = on_stages(stash[stage_ids, bc % K])
        ex_b = {k: at(v, bc) for k, v in extras.items()}
        _, vjp = jax.vjp(lambda prm, h: stage(prm, h, bc, ex_b), params, h_b)
        d_params, d_h = vjp(g_in)
        g_params = jax.tree.map(lambda a, d: a + masked(valid_b, d), g_params, d_params)
        bwd_out = on_stages(masked(valid_b, d_h))
        dxs = jnp.where(valid_b[0], dxs.at[bc[0]].set(d_h[0]), dxs)

        # Forward: stage s on microbatch t - s; stage 0 reads it, stage s > 0 takes stage
        # s - 1's output of the last tick. The input is stashed for the backward pass.
        f = t - stage_ids
        valid_f = (f >= 0) & (f < M)
        fc = jnp.clip(f, 0, M - 1)
        h_f = on_stages(jnp.concatenate([xs[fc[0]][None], fwd_out[:-1]], axis=0))
        out = on_stages(stage(params, h_f, fc, {k: at(v, fc) for k, v in extras.items()}))
        old = stash[stage_ids, fc % K]
        stash = stash.at[stage_ids, fc % K].set(_where(valid_f, h_f, old))

        # The loss head on what the last stage just finished: its gradient starts the
        # backward pass of that microbatch at the next tick.
        last = t - S + 1
        valid_l = (last >= 0) & (last < M)
        lab = at(labels, jnp.clip(last, 0, M - 1))
        value, head_vjp = jax.vjp(lambda hp, h: head(hp, h, lab), head_params, out[S - 1])
        d_hp, d_last = head_vjp(jnp.ones_like(value))
        g_head = jax.tree.map(lambda a, d: a + jnp.where(valid_l, d, 0), g_head, d_hp)
        head_grad = whole(jnp.where(valid_l, d_last, 0).astype(head_grad.dtype), RESIDUAL_AXES)
        loss = loss + jnp.where(valid_l, value, 0)
        return (out, bwd_out, head_grad, stash, g_params, g_head, dxs, loss), None

    state = jnp.zeros((S, *xs.shape[1:]), xs.dtype)
    carry = (
        state,
        state,
        jnp.zeros(xs.shape[1:], xs.dtype),
        constrain(jnp.zeros((S, K, *xs.shape[1:]), xs.dtype), (STAGE, None, *RESIDUAL_AXES)),
        jax.tree.map(jnp.zeros_like, params),
        jax.tree.map(jnp.zeros_like, head_params),
        jnp.zeros_like(xs),
        jnp.zeros((), jnp.float32),
    )
    (_, _, _, _, g_params, g_head, dxs, loss), _ = jax.lax.scan(
        tick, carry, jnp.arange(M + 2 * S - 1)
    )
    return loss, (g_params, g_head, whole(dxs, (None, *RESIDUAL_AXES)))


def masked(valid: jax.Array, value: jax.Array) -> jax.Array:
    """`value` [S, ...] with stage rows where `valid` [S] is False set to zero."""
    return _where(valid, value, jnp.zeros_like(value))


def _where(valid: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - 1)), a, b)

"""Pipeline schedules that run the backward pass themselves: 1F1B and zero-bubble ZB-H1.

Autodiff of a scanned pipeline runs every forward before any backward and keeps what every
microbatch's forward saved. Here the schedule computes the loss and its gradients itself;
`jax.custom_vjp` hands them to the caller's autodiff. Time is cut into ticks; at each tick
every stage runs the same slots at once (a `vmap` over stages), each stage on its own
microbatch, masked where it has none:

- `F`: stage s runs the forward pass of microbatch t - s and stashes its input; the last
  stage's output goes through the loss head at once, whose gradient starts that
  microbatch's backward pass at the next tick;
- `B` (1F1B): stage s runs the backward pass of microbatch t - 2S + 1 + s, recomputing its
  forward from the stashed input; the cotangent is stage s + 1's input gradient;
- ZB-H1 splits `B` into `Bi`, the input gradient alone (the chain between stages), and `W`,
  the weights' gradient, which depends on nothing downstream: stage s runs the `W` of
  microbatch t - 2S + 1 (s ticks after its `Bi`), so every stage's `W`s fall in the same M
  ticks.

A tick costs the slots any stage runs in it (F, Bi and W one unit each, B two), so the scan
is cut into phases of ticks with the same slots, each its own `lax.scan`: 1F1B's first S
ticks run F alone and its last S ticks B alone, for an idle share of (S - 1) / (M + S - 1);
ZB-H1's W fills M of the Bi ticks: (2S - 2) / (3M + 2S - 2). `schedule_table` is the table
both are computed from, which `axplug aot` prints. Each stage keeps min(M, 2S) stage inputs
(and with ZB-H1, S output cotangents), not M microbatches' activations. Every `Bi` and `W`
recomputes its stage's forward from the stashed input (as 1F1B's `B` does once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from axplug.api.layers import RESIDUAL_AXES
from axplug.api.sharding import constrain

__all__ = ["SELF_DIFFERENTIATED", "one_f_one_b", "masked", "schedule_table", "table_bubble"]

STAGE = "stage"
SELF_DIFFERENTIATED = ("1f1b", "zbh1")
_UNITS = {"F": 1, "B": 2, "Bi": 1, "W": 1}  # cost of a slot; F, Bi and W alike


def _first_tick(slot: str, S: int) -> int:
    return {"F": 0, "B": S, "Bi": S, "W": 2 * S - 1}[slot]


def _micro(slot: str, t, stage, S: int):
    """The microbatch `stage` works on in `slot` at tick `t` (out of range: idle)."""
    if slot == "F":
        return t - stage
    if slot == "W":
        return t - 2 * S + 1 + 0 * stage
    return t - 2 * S + 1 + stage  # B, Bi


def _slots(schedule: str) -> tuple[str, ...]:
    return ("F", "B") if schedule == "1f1b" else ("F", "Bi", "W")


def schedule_table(schedule: str, S: int, M: int) -> list[list[list[tuple[str, int]]]]:
    """[tick][stage] -> the (slot, microbatch) pairs the stage runs in that tick."""
    table = []
    for t in range(M + 2 * S - 1):
        row = []
        for s in range(S):
            row.append([(k, m) for k in _slots(schedule) if 0 <= (m := _micro(k, t, s, S)) < M])
        table.append(row)
    return table


def _phases(schedule: str, S: int, M: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """(first tick, end tick, slots any stage runs) of each run of ticks alike."""
    table = schedule_table(schedule, S, M)
    phases: list[tuple[int, int, tuple[str, ...]]] = []
    for t, row in enumerate(table):
        active = tuple(k for k in _slots(schedule) if any(k == s for cell in row for s, _ in cell))
        if phases and phases[-1][2] == active:
            phases[-1] = (phases[-1][0], t + 1, active)
        else:
            phases.append((t, t + 1, active))
    return phases


def table_bubble(schedule: str, S: int, M: int) -> float:
    """The idle share of the stages' time: each tick lasts the units of the slots any stage
    runs in it; each stage is busy 3 units per microbatch."""
    total = sum((end - start) * sum(_UNITS[k] for k in active)
                for start, end, active in _phases(schedule, S, M))  # fmt: skip
    return 1.0 - 3 * M / total


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
    schedule: str = "1f1b",
) -> jax.Array:
    """Sum over microbatches of `head(head_params, stages(xs[m]), labels[m])`.

    `stage(params, h, micro, extras)`: every stage at once, h [S, mb, ...] -> [S, mb, ...],
    stage s on microbatch micro[s]. `xs` [M, mb, ...] are the microbatched inputs, `labels`
    and each of `extras` [M, ...] per microbatch. Differentiable in params, head_params, xs.
    `schedule`: `1f1b` or `zbh1`.
    """
    run = functools.partial(_schedule, stage, head, whole, schedule)
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


class _Carry(NamedTuple):
    fwd_out: jax.Array  # [S, mb, ...] each stage's output of the last tick
    bwd_out: jax.Array  # [S, mb, ...] each stage's input gradient of the last tick
    head_grad: jax.Array  # [mb, ...] the head's gradient of the last stage's last output
    stash: jax.Array  # [S, K, mb, ...] stage inputs by microbatch % K
    cotangents: jax.Array  # [S, S, mb, ...] (ZB-H1) output cotangents awaiting their W
    g_params: Any
    g_head: Any
    dxs: jax.Array
    loss: jax.Array


def _schedule(stage, head, whole, schedule, params, head_params, xs, labels, extras):
    """(loss sum, (d params, d head_params, d xs)) by `schedule`, phase by phase."""
    M = xs.shape[0]
    S = jax.tree.leaves(params)[0].shape[0]
    K = min(M, 2 * S)  # stash slots per stage: microbatches between F and the last W
    stage_ids = jnp.arange(S)

    def at(v, micro):  # per-stage rows of a per-microbatch array
        return jnp.take(v, micro, axis=0)

    def on_stages(a):
        return constrain(a, (STAGE, *RESIDUAL_AXES))

    def slot_of(kind, t):
        m = _micro(kind, t, stage_ids, S)
        return (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)

    def backward(c: _Carry, t, kind: str) -> _Carry:
        # B / Bi: the cotangent is stage s + 1's input gradient (the last stage's: the head's).
        valid, mc = slot_of(kind, t)
        g_in = on_stages(jnp.concatenate([c.bwd_out[1:], c.head_grad[None]], axis=0))
        h = on_stages(c.stash[stage_ids, mc % K])
        ex = {k: at(v, mc) for k, v in extras.items()}
        if kind == "B":
            _, vjp = jax.vjp(lambda prm, h: stage(prm, h, mc, ex), params, h)
            d_params, d_h = vjp(g_in)
            c = c._replace(g_params=jax.tree.map(
                lambda a, d: a + masked(valid, d), c.g_params, d_params))  # fmt: skip
        else:  # Bi: the input gradient alone; the cotangent waits for its W
            _, vjp = jax.vjp(lambda h: stage(params, h, mc, ex), h)
            (d_h,) = vjp(g_in)
            old = c.cotangents[stage_ids, mc % S]
            c = c._replace(cotangents=c.cotangents.at[stage_ids, mc % S].set(
                _where(valid, g_in, old)))  # fmt: skip
        dxs = jnp.where(valid[0], c.dxs.at[mc[0]].set(d_h[0]), c.dxs)
        return c._replace(bwd_out=on_stages(masked(valid, d_h)), dxs=dxs)

    def weights(c: _Carry, t) -> _Carry:
        valid, mc = slot_of("W", t)
        h = on_stages(c.stash[stage_ids, mc % K])
        g = on_stages(c.cotangents[stage_ids, mc % S])
        ex = {k: at(v, mc) for k, v in extras.items()}
        _, vjp = jax.vjp(lambda prm: stage(prm, h, mc, ex), params)
        (d_params,) = vjp(g)
        return c._replace(g_params=jax.tree.map(
            lambda a, d: a + masked(valid, d), c.g_params, d_params))  # fmt: skip

    def forward(c: _Carry, t) -> _Carry:
        # Stage 0 reads microbatch t, stage s > 0 stage s - 1's output of the last tick.
        valid, fc = slot_of("F", t)
        h = on_stages(jnp.concatenate([xs[fc[0]][None], c.fwd_out[:-1]], axis=0))
        out = on_stages(stage(params, h, fc, {k: at(v, fc) for k, v in extras.items()}))
        old = c.stash[stage_ids, fc % K]
        stash = c.stash.at[stage_ids, fc % K].set(_where(valid, h, old))
        # The loss head on what the last stage just finished: its gradient starts the
        # backward pass of that microbatch at the next tick.
        last = t - S + 1
        valid_l = (last >= 0) & (last < M)
        lab = at(labels, jnp.clip(last, 0, M - 1))
        value, head_vjp = jax.vjp(lambda hp, h: head(hp, h, lab), head_params, out[S - 1])
        d_hp, d_last = head_vjp(jnp.ones_like(value))
        g_head = jax.tree.map(lambda a, d: a + jnp.where(valid_l, d, 0), c.g_head, d_hp)
        head_grad = whole(jnp.where(valid_l, d_last, 0).astype(c.head_grad.dtype), RESIDUAL_AXES)
        return c._replace(
            fwd_out=out, stash=stash, head_grad=head_grad, g_head=g_head,
            loss=c.loss + jnp.where(valid_l, value, 0),
        )  # fmt: skip

    def phase(active):
        def tick(c: _Carry, t):
            # The backward slots read the last tick's values, so they run before F.
            for kind in ("B", "Bi"):
                if kind in active:
                    c = backward(c, t, kind)
            if "W" in active:
                c = weights(c, t)
            if "F" in active:
                c = forward(c, t)
            return c, None

        return tick

    state = jnp.zeros((S, *xs.shape[1:]), xs.dtype)
    stage_major = (STAGE, None, *RESIDUAL_AXES)
    waiting = S if schedule == "zbh1" else 1
    c = _Carry(
        fwd_out=state,
        bwd_out=state,
        head_grad=jnp.zeros(xs.shape[1:], xs.dtype),
        stash=constrain(jnp.zeros((S, K, *xs.shape[1:]), xs.dtype), stage_major),
        cotangents=constrain(jnp.zeros((S, waiting, *xs.shape[1:]), xs.dtype), stage_major),
        g_params=jax.tree.map(jnp.zeros_like, params),
        g_head=jax.tree.map(jnp.zeros_like, head_params),
        dxs=jnp.zeros_like(xs),
        loss=jnp.zeros((), jnp.float32),
    )
    for start, end, active in _phases(schedule, S, M):
        c, _ = jax.lax.scan(phase(active), c, jnp.arange(start, end))
    return c.loss, (c.g_params, c.g_head, whole(c.dxs, (None, *RESIDUAL_AXES)))


def masked(valid: jax.Array, value: jax.Array) -> jax.Array:
    """`value` [S, ...] with stage rows where `valid` [S] is False set to zero."""
    return _where(valid, value, jnp.zeros_like(value))


def _where(valid: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - 1)), a, b)

"""Drop-free expert parallelism by ragged all-to-all: every row moves at its exact size.

Each device sorts its choices by the expert shard that owns them and sends each shard exactly
its rows (`jax.lax.ragged_all_to_all`), after the sizes are exchanged (a small all-to-all of
counts). A receiver takes at most `buffer` rows a round, filled from its senders in device
order; a round moves what fits, runs it on the device's experts and sends the outputs back to
the rows they came from, and rounds repeat until every row has been served (one round when
routing is balanced). So the buffers are the same size however many devices there are, and
nothing drops. The backward pass (a custom VJP) runs the same rounds: the outputs'
cotangents travel like the rows, each round's expert gradients are taken by recomputing its
forward, and the rows' gradients travel back.

XLA:CPU (and TPU v5e's compiler) has no ragged all-to-all: there `emulated_ragged_all_to_all`
does the same exchange with a padded `all_to_all` (each device sends every shard a chunk the
size of all its rows), so the rounds run, and are tested, on CPU; `has_ragged_all_to_all` is
the gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug_moe.dispatch import Experts, balanced_rows

__all__ = ["emulated_ragged_all_to_all", "has_ragged_all_to_all", "ragged_experts"]

_RAGGED_BACKENDS = ("gpu", "cuda", "rocm", "tpu")
# The TPU compiler refuses the op where ICI routing is limited (measured with libtpu 0.0.42:
# v5e refuses, v4, v5p and v6e compile it).
_NO_RAGGED_KINDS = ("TPU v5 lite",)


def has_ragged_all_to_all(backend: str, device_kind: str = "") -> bool:
    """Whether XLA implements `ragged-all-to-all` on `backend` for devices of `device_kind`
    (not XLA:CPU, not TPU v5e)."""
    return backend in _RAGGED_BACKENDS and device_kind not in _NO_RAGGED_KINDS


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`'s exchange by a padded `all_to_all`, for backends without
    the op: each device's chunk for device j, `operand[input_offsets[j]:][:send_sizes[j]]`,
    lands in device j's `output` at `output_offsets[j]`; other rows of `output` stay."""
    m, shards = operand.shape[0], send_sizes.shape[0]
    rank = jnp.arange(m)
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])

    def chunk(offset, size):
        part = jax.lax.dynamic_slice_in_dim(padded, offset, m)
        keep = (rank < size).reshape((m,) + (1,) * (operand.ndim - 1))
        return jnp.where(keep, part, jnp.zeros_like(part))

    chunks = jax.vmap(chunk)(input_offsets, send_sizes)  # [shards, m, ...]
    arrived = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # in my output
    rows = jnp.where(rank < recv_sizes[:, None], at[:, None] + rank, output.shape[0])
    del shards
    return output.at[rows.reshape(-1)].set(arrived.reshape(-1, *operand.shape[1:]), mode="drop")


@dataclasses.dataclass(frozen=True)
class _Rounds:
    axes: Any  # the mesh axes that split the experts
    buffer: int  # rows a receiver takes a round
    slots: int  # the receiving side's balanced buffer per local expert
    tile: int  # its overflow tile
    activation: Callable
    transfer: Callable  # jax.lax.ragged_all_to_all or emulated_ragged_all_to_all

    def exchange(self, v):
        """[shards] -> [shards]: element j to device j; element i came from device i."""
        return jax.lax.all_to_all(v, self.axes, 0, 0, tiled=True)

    def plan(self, send_sizes, sent):
        """This round: (grant [dest], land [dest], from_offset [dest], accept [src],
        at [src], back [src]): rows sent to each shard, where they land there, where they
        start here; rows taken from each sender, where they sit in the buffer, where their
        outputs go in the sender's rows."""
        waiting = self.exchange(send_sizes - sent)  # rows each sender still has for me
        before = jnp.cumsum(waiting) - waiting
        accept = jnp.clip(self.buffer - before, 0, waiting)  # in sender order, as they fit
        at = jnp.cumsum(accept) - accept
        from_offset = jnp.cumsum(send_sizes) - send_sizes + sent
        grant, land, back = self.exchange(accept), self.exchange(at), self.exchange(from_offset)
        return grant, land, from_offset, accept, at, back

    def receive(self, rows, local, plan, fill):
        """(buffer rows [buffer, dim], their local experts [buffer]; `fill`: none)."""
        grant, land, offset, accept, _, _ = plan
        out = jnp.zeros((self.buffer, *rows.shape[1:]), rows.dtype)
        ids = jnp.full((self.buffer,), fill, jnp.int32)
        send = lambda a, o: self.transfer(a, o, offset, grant, land, accept, axis_name=self.axes)  # noqa: E731
        return send(rows, out), send(local, ids)

    def send_back(self, buffered, into, plan):
        """Rows of the buffer back to where they came from, written into `into`."""
        grant, _, _, accept, at, back = plan
        return self.transfer(buffered, into, at, accept, back, grant, axis_name=self.axes)

    def run(self, buffered, ids, weights):
        experts = Experts(weights[0], weights[1], self.activation, weights[2])
        token = jnp.arange(self.buffer, dtype=jnp.int32)
        return balanced_rows(buffered, ids, token, experts, self.slots, self.tile)[0]

    def loop(self, send_sizes, body, init):
        """`body(plan, state)` a round at a time until every device has sent every row."""

        def more(carry):
            sent, _ = carry
            return jax.lax.psum(jnp.sum(send_sizes - sent), self.axes) > 0

        def step(carry):
            sent, state = carry
            plan = self.plan(send_sizes, sent)
            return sent + plan[0], body(plan, state)

        return jax.lax.while_loop(more, step, (jnp.zeros_like(send_sizes), init))[1]


def ragged_experts(rows, local, send_sizes, weights, **settings):
    """One device's expert outputs [m, dim] for its `rows` [m, dim], sorted by destination
    shard (`send_sizes` [shards] rows for each, then rows that go nowhere), each run by local
    expert `local` [m] of its shard; `weights` (up, out, gate or None) are this device's
    experts'. `settings`: the fields of `_Rounds`. Inside a shard_map over `axes`."""
    rounds = _Rounds(**settings)
    none = weights[0].shape[0]  # this device's expert count: "no expert"

    @jax.custom_vjp
    def serve(rows, weights, local, send_sizes):
        return _forward(rows, weights, local, send_sizes)

    def _forward(rows, weights, local, send_sizes):
        def body(plan, out):
            buffered, ids = rounds.receive(rows, local, plan, none)
            return rounds.send_back(rounds.run(buffered, ids, weights), out, plan)

        return rounds.loop(send_sizes, body, jnp.zeros_like(rows))

    def forward(rows, weights, local, send_sizes):
        out = _forward(rows, weights, local, send_sizes)
        return out, (rows, weights, local, send_sizes)

    def backward(residuals, d_out):
        rows, weights, local, send_sizes = residuals

        def body(plan, state):
            d_rows, d_weights = state
            buffered, ids = rounds.receive(rows, local, plan, none)
            d_buffered_out, _ = rounds.receive(d_out, local, plan, none)
            _, vjp = jax.vjp(lambda b, w: rounds.run(b, ids, w), buffered, weights)
            d_buffered, d_w = vjp(d_buffered_out)
            d_weights = jax.tree.map(jnp.add, d_weights, d_w)
            return rounds.send_back(d_buffered, d_rows, plan), d_weights

        zeros = (jnp.zeros_like(rows), jax.tree.map(jnp.zeros_like, weights))
        d_rows, d_weights = rounds.loop(send_sizes, body, zeros)
        return d_rows, d_weights, _float0(local), _float0(send_sizes)

    serve.defvjp(forward, backward)
    return serve(rows, weights, local, send_sizes)


def _float0(x):
    return np.zeros(x.shape, jax.dtypes.float0)

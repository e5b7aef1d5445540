"""The ragged exchange's rounds against plain math: skewed routing (every device sending most
rows to one shard) through a small receive buffer, values and gradients equal to running each
row on its expert directly; the emulated op against `ragged_all_to_all`'s definition; the gate
that picks the real op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

pytest.importorskip("axplug_moe")

from axplug_moe.alltoall import AllToAllDispatch  # noqa: E402
from axplug_moe.ragged import (  # noqa: E402
    emulated_ragged_all_to_all,
    has_ragged_all_to_all,
    ragged_experts,
)

SHARDS, LOCAL, ROWS, DIM, HIDDEN = 4, 2, 12, 8, 16  # devices, experts each, rows each


def dense(rows, expert, w_up, w_out):
    """Each row through its expert (global index; -1: none -> zeros), plain jnp."""
    h = jax.nn.gelu(jnp.einsum("md,mdh->mh", rows, w_up[jnp.maximum(expert, 0)]))
    out = jnp.einsum("mh,mhd->md", h, w_out[jnp.maximum(expert, 0)])
    return jnp.where((expert >= 0)[:, None], out, 0.0)


def problem():
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(SHARDS * ROWS, DIM)), jnp.float32)
    # Skewed: three quarters of every device's rows go to shard 0's experts; some go nowhere.
    expert = np.where(rng.random(SHARDS * ROWS) < 0.75, rng.integers(0, LOCAL, SHARDS * ROWS),
                      rng.integers(0, SHARDS * LOCAL, SHARDS * ROWS))  # fmt: skip
    expert[::7] = -1
    w_up = jnp.asarray(rng.normal(size=(SHARDS * LOCAL, DIM, HIDDEN)) / 3, jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(SHARDS * LOCAL, HIDDEN, DIM)) / 3, jnp.float32)
    return rows, jnp.asarray(expert, jnp.int32), w_up, w_out


def sharded_experts(transfer):
    """Every device's rows through `ragged_experts` (a 5-row buffer) over 4 devices."""

    def per_device(rows, expert, w_up, w_out):
        dest = jnp.where(expert >= 0, expert // LOCAL, SHARDS)
        dest_sorted, order = jax.lax.sort((dest, jnp.arange(ROWS)), num_keys=1)
        sizes = jnp.sum(jax.nn.one_hot(dest, SHARDS, dtype=jnp.int32), axis=0)
        local = jnp.where(dest_sorted < SHARDS, expert[order] % LOCAL, LOCAL)
        out = ragged_experts(
            rows[order], local, sizes, (w_up, w_out, None), axes="expert", buffer=5,
            slots=3, tile=1, activation=jax.nn.gelu, transfer=transfer,
        )  # fmt: skip
        return jnp.zeros_like(out).at[order].set(out)

    spec = PartitionSpec("expert")
    mesh = Mesh(np.array(jax.devices()[:SHARDS]), ("expert",))
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec,
                         check_vma=False)  # fmt: skip


def grads(f):
    def value(*args):
        out = f(*args)
        return jnp.sum(out**2), out

    return jax.value_and_grad(value, argnums=(0, 2, 3), has_aux=True)


def test_rounds_through_a_small_buffer_equal_each_row_on_its_expert():
    rows, expert, w_up, w_out = problem()
    calls = np.zeros(1, np.int64)

    def counted(*args, axis_name):
        jax.debug.callback(lambda: calls.__setitem__(0, calls[0] + 1))
        return emulated_ragged_all_to_all(*args, axis_name=axis_name)

    run = sharded_experts(counted)
    (_, got), got_grads = jax.jit(grads(run))(rows, expert, w_up, w_out)
    (_, want), want_grads = jax.jit(grads(dense))(rows, expert, w_up, w_out)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
    # Shard 0 receives most rows: more than its 5-row buffer takes in one round. Each device
    # each round: rows, expert ids and outputs forward; those and the cotangents backward.
    received = np.bincount(np.asarray(expert)[np.asarray(expert) >= 0] // LOCAL)
    rounds = int(np.ceil(received.max() / 5))
    assert rounds > 3 and calls[0] == SHARDS * (3 + 5) * rounds


def test_the_real_op_lowers_for_gpu_forward_and_backward():
    """With `jax.lax.ragged_all_to_all` (what a GPU or TPU mesh runs) the same rounds lower
    for CUDA, gradients included: the op itself, not the emulation's all-to-alls."""
    step = jax.jit(grads(sharded_experts(jax.lax.ragged_all_to_all)))
    text = step.trace(*problem()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_all_to_all") >= 8  # rows, ids, outputs; backward: 5 more


def test_emulated_exchange_is_ragged_all_to_alls_definition():
    """Device i's chunk for device j, operand[in_off[i, j]:][:size[i, j]], lands at
    out_off[i, j] in device j's output; the rest of each output stays as it was."""
    rng = np.random.default_rng(1)
    n, m, out_rows = SHARDS, 6, 10
    sizes = rng.integers(0, 3, size=(n, n)).astype(np.int32)
    in_off = np.cumsum(sizes, axis=1) - sizes
    at_receiver = np.cumsum(sizes, axis=0) - sizes  # device j stacks senders in order
    operand = rng.normal(size=(n, m, 3)).astype(np.float32)
    output = np.full((n, out_rows, 3), 7.0, np.float32)
    want = output.copy()
    for i in range(n):
        for j in range(n):
            chunk = operand[i, in_off[i, j] : in_off[i, j] + sizes[i, j]]
            want[j, at_receiver[i, j] : at_receiver[i, j] + sizes[i, j]] = chunk
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

    def per_device(operand, output, in_off, sizes, out_off, recv):
        got = emulated_ragged_all_to_all(
            operand[0], output[0], in_off[0], sizes[0], out_off[0], recv[0], axis_name="x"
        )
        return got[None]

    spec = PartitionSpec("x")
    got = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec,
                                check_vma=False))(
        operand, output, in_off, sizes, at_receiver, sizes.T.copy()
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_auto_takes_the_ragged_op_where_the_backend_has_it():
    assert has_ragged_all_to_all("gpu") and has_ragged_all_to_all("tpu", "TPU v5")
    assert not has_ragged_all_to_all("cpu") and not has_ragged_all_to_all("tpu", "TPU v5 lite")
    auto = AllToAllDispatch.default_config().instantiate(parent=None)
    assert [auto.exchange_for(p) for p in ("gpu", "tpu", "cpu")] == ["ragged", "ragged", "padded"]
    capped = AllToAllDispatch.default_config().set(capacity_factor=1.0).instantiate(parent=None)
    assert capped.exchange_for("gpu") == "padded"  # a capacity: static buffers are flat
    assert auto.exchange_for("tpu", "TPU v5 lite") == "padded"  # v5e's compiler refuses it
    with pytest.raises(Exception, match="exchange: must be one of auto, padded, ragged"):
        AllToAllDispatch.default_config().set(exchange="scatter").instantiate(parent=None)


def test_the_platform_of_a_mesh_without_devices_is_the_default_backend():
    """Under `jax.set_mesh` the scope's mesh is abstract: the exchange falls back to the
    default backend's answer rather than failing on its missing devices."""
    from axplug_moe.alltoall import platform_of

    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    assert platform_of(mesh) == ("cpu", jax.devices()[0].device_kind)
    with jax.set_mesh(mesh):
        assert platform_of(jax.sharding.get_abstract_mesh()) == (jax.default_backend(), "")

"""Expert parallelism by explicit all-to-all (`dispatch=alltoall`) on 8 fake CPU devices:
drop-free it trains exactly like one device; tokens move only by all-to-all (every other
collective that moves data gathers or reduces parameters); a per-destination capacity drops
and says so.

Tolerances: losses rtol 1e-5 (the same math reduced in another order), parameters rtol 1e-3
/ atol 1e-3 after three Adam steps at learning rate 1e-2: Adam scales a gradient that is
rounding noise up to a whole step (on an AVX-512 host one coordinate in 49,152 moved 6.1e-4).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

pytest.importorskip("axplug_moe")

from axplug_testing import train_steps  # noqa: E402

from axplug.api.config import make_modifier  # noqa: E402
from test_moe_plugin import metrics, tiny_llama, with_jsonl  # noqa: E402

STEPS = 3
ONE, MESH = (1, 1, 1, 1, 1), (2, 2, 2, 1, 1)  # (data, fsdp, expert, seq, model)


def trainer(run_dir, mesh, send_capacity=None, routing="softmax", **dispatch):
    """Drop-free routing through `alltoall`; `send_capacity`: its own capacity factor;
    `dispatch`: more of its fields."""
    from axplug_moe import DeepSeekRouter, MoEFeedForward

    from axplug.api.config import find_configs

    cfg = tiny_llama(run_dir, STEPS, mesh)
    cfg.model.decoder.transformer.num_layers = 1  # one MoE layer: its dispatch is the claim
    moe = "moe:num_experts=8,top_k=2,hidden_dim=96,capacity_factor=None,dispatch=alltoall"
    cfg = with_jsonl(make_modifier(moe)(cfg))
    for _, layer in find_configs(cfg, MoEFeedForward):
        layer.dispatch.capacity_factor = send_capacity
        layer.dispatch.set(**dispatch)
        if routing == "deepseek":  # sigmoid scores, bias-corrected group-limited top-k
            layer.num_shared_experts = 1
            layer.router = DeepSeekRouter.default_config().set(
                top_k=2, num_groups=4, top_groups=2, scaling_factor=2.5,
                capacity_factor=None, bias_update_rate=1e-3,
            )  # fmt: skip
    devices = jax.devices()[: int(np.prod(mesh))]
    return cfg.instantiate(devices=devices)


def train(t, start):
    """(its state, each step's metrics) after STEPS train steps of the trainer `t` from `start`
    (host arrays: onto a mesh without a program per shape): the built step alone (no
    checkpoint or writer, not what is tested)."""
    return train_steps(t, STEPS, start)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """(each step's metrics, the final parameters, the initial state on the host) on one
    device. The meshes start from that state: the step's dispatch is the claim, not the
    sharded init (the core's sharding tests hold that), and one init compiles, not two."""
    t = trainer(tmp_path_factory.mktemp("one"), ONE)
    start = jax.tree.map(np.array, jax.device_get(t.init_state()))
    state, rows = train(t, start)
    return rows, jax.device_get(state["params"]), start


@pytest.mark.slow  # ~18 s: two more 3-step runs
def test_deepseek_routing_and_a_shared_expert_take_the_same_path(tmp_path):
    # Every routing variant reaches the experts through the same dispatch: DeepSeek-V3's
    # (bias state updated each step) with a shared expert, on 8 devices as on one.
    one = trainer(tmp_path / "one", ONE, routing="deepseek")
    one.run()
    many = trainer(tmp_path / "many", MESH, routing="deepseek")
    many.run()
    want, got = metrics(tmp_path / "one"), metrics(tmp_path / "many")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    bias = [
        jax.device_get(
            t.state["params"]["decoder"]["transformer"]["layer0"]["feed_forward"]["router"][
                "e_score_correction_bias"
            ]
        )
        for t in (one, many)
    ]
    np.testing.assert_allclose(bias[1], bias[0], atol=1e-6)
    assert np.abs(bias[0]).max() > 0  # the balancing state moved
    assert all(r["moe/dropped_fraction"] == 0.0 for r in got)


OPS = "all-to-all|all-gather|all-reduce|reduce-scatter"


def moving_collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result shape) of the collectives whose groups hold more than one device."""
    out = []
    for line in hlo.splitlines():
        found = re.search(rf"= (.*?) ({OPS})(?:-start)?\(", line)
        groups = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", line)
        if found and not (groups and re.fullmatch(r"(\{\d+\},?)+", groups.group(1) + "}")):
            out.append((found.group(2), found.group(1)))
    return out


def matches_one_device(t, one_device) -> None:
    """Trainer `t`, run from the one-device start: the same losses and parameters, nothing
    dropped, and tokens moved only by all-to-alls (every all-gather a parameter's)."""
    rows, want_params, start = one_device
    state, got = train(t, start)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in rows], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3),
        jax.device_get(state["params"]),
        want_params,
    )
    assert all(r["moe/dropped_fraction"] == 0.0 for r in got)
    assert got[-1]["moe/device_load"] == pytest.approx(0.5)  # two shards: mean 1/2

    hlo = t._train_step.lower(state, t.put_batch(t.input.batch(0))).compile().as_text()
    moving = moving_collectives(hlo)
    assert any(op == "all-to-all" for op, _ in moving), moving
    # Everything else gathers parameters: shapes of a parameter, its experts cut to the
    # device's 4, or its FSDP shard; never a token-shaped array.
    params = jax.tree.leaves(state["params"])
    allowed = set()
    for p in params:
        shape = list(p.shape)
        allowed.add(tuple(shape))
        if len(shape) == 3:
            allowed.add((4, *shape[1:]))
    gathered = [s for op, s in moving if op == "all-gather"]
    for shape in gathered:
        dims = tuple(int(d) for d in re.findall(r"\[(.*?)\]", shape)[0].split(",") if d)
        assert dims in allowed, (shape, sorted(allowed))


def test_drop_free_all_to_all_matches_one_device(tmp_path, one_device):
    assert jax.device_count() == 8, "the root conftest.py sets 8 fake CPU devices"
    matches_one_device(trainer(tmp_path, MESH), one_device)


def test_a_capacity_per_destination_drops_and_reports_it(tmp_path, one_device):
    _, got = train(trainer(tmp_path, MESH, send_capacity=0.5), one_device[2])
    assert all(np.isfinite(r["loss"]) for r in got)
    # The router drops nothing; the send capacity (half an even share per shard) does, and
    # `moe/dropped_fraction` is the mean of the router's 0 and the dispatch's share.
    assert all(0.0 < r["moe/dropped_fraction"] < 0.5 for r in got)


def test_ragged_exchange_in_rounds_matches_one_device(tmp_path, one_device):
    """Rows moved at their exact sizes (ragged all-to-all, emulated on XLA:CPU) through a
    receive buffer of a third of a device's choices, so every step takes several rounds:
    the same losses and parameters as one device, nothing dropped, only all-to-alls move
    tokens."""
    t = trainer(tmp_path, MESH, exchange="ragged", ragged_buffer_factor=0.3)
    matches_one_device(t, one_device)

"""Drop-free MoE through the `balanced` dispatch: the buffer and overflow tiles at their
edges against the float64 reference, and a whole preset trained against a plain-jnp
reference that runs each token's choices one token at a time.

Tolerances as in test_moe_plugin.py: layer outputs 1e-5 against float64, gradients 1e-4;
whole-model losses 1e-5 relative (the same float32 math in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("axplug_moe")

from axplug_moe import BalancedDispatch, Dispatch, MoEFeedForward  # noqa: E402
from axplug_testing import tiny_trainer_config, train_steps  # noqa: E402

from axplug.api.config import find_configs  # noqa: E402
from axplug.api.layers import functional  # noqa: E402
from test_moe_plugin import (  # noqa: E402
    F32_LOOSE,
    PROBE,
    assert_close,
    jnp_reference,
    layer_params,
    moe_cfg,
    ref_moe,
    run,
    skewed_case,
)


def balanced(buffer_factor, tile_size, **kwargs):
    cfg = moe_cfg("balanced", capacity_factor=None, **kwargs)
    cfg.dispatch.set(buffer_factor=buffer_factor, tile_size=tile_size)
    return cfg


def overflow_rows(x, w, top_k, slots):
    """Choices past `slots` per expert, from the numpy routing."""
    logits = np.asarray(x, np.float64) @ np.asarray(w["router"], np.float64)
    index = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
    counts = np.bincount(index.ravel(), minlength=w["router"].shape[1])
    return int(np.maximum(counts - slots, 0).sum())


# (buffer_factor, tile_size): most rows in partial 3-row tiles; one-row tiles; a buffer
# wider than any expert's load (no overflow); the defaults (the tile capped at the 32
# choices, wider than an expert's overflow here, so each pads).
_DEFAULT = BalancedDispatch.default_config()
EDGES = {
    "tiles_of_3": (0.1, 3),
    "tiles_of_1": (0.5, 1),
    "no_overflow": (4.0, 2),
    "defaults": (_DEFAULT.buffer_factor, _DEFAULT.tile_size),
}


# Gated (silu) experts at every edge; ungated (relu) ones, the experts' other function, once,
# where both the buffer and partial overflow tiles run them (the edges are the dispatch's, not
# the experts': they run the same code gated or not).
@pytest.mark.parametrize("edge, gated", [*((edge, True) for edge in EDGES), ("tiles_of_3", False)])
def test_buffer_and_overflow_tiles_match_the_reference(edge, gated):
    buffer_factor, tile_size = EDGES[edge]
    x, w = skewed_case(gated=gated)
    activation = "silu" if gated else "relu"
    y, collection = run(
        balanced(buffer_factor, tile_size, gated=gated, activation=activation),
        layer_params(w),
        x,
    )
    want, stats = ref_moe(x, w, top_k=2, capacity_factor=None, activation=activation)
    assert_close(y, want)
    assert stats["dropped_fraction"] == 0.0
    m = x.shape[0] * x.shape[1] * 2
    slots = max(1, min(m, int(np.ceil(buffer_factor * m / w["router"].shape[1]))))
    spilled = overflow_rows(x, w, 2, slots)
    summaries = collection.summaries["dispatch"]
    assert_close(summaries["moe/overflow_fraction"], spilled / m)
    loop_rows = int(summaries["moe/overflow_rows"])
    if edge == "no_overflow":
        assert spilled == 0 and loop_rows == 0
    else:  # every overflow row ran, padded by less than a tile per expert
        tile = min(tile_size, m)
        assert spilled > 0 and spilled <= loop_rows < spilled + tile * w["router"].shape[1]
        assert loop_rows % tile == 0


@pytest.mark.parametrize("edge", ["tiles_of_3", "no_overflow"])
def test_gradients_through_the_overflow_match_a_dense_reference(edge):
    x, w = skewed_case()
    assert_gradients_match(balanced(*EDGES[edge]), x, w, PROBE)


def assert_gradients_match(cfg, x, w, probe):
    """Gradients of sum(layer(x) * probe) in the weights and x: the layer `cfg` against the
    plain-jnp dense reference, drop-free top-2."""
    model = cfg.instantiate(parent=None)

    def loss(params, x):
        y, _ = functional(model, prng_key=None, state=params, inputs=(x,), is_training=True)
        return jnp.sum(y * probe)

    args = (layer_params(w), jax.device_put(x))  # `jnp.asarray` would compile a program
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    want = reference_grads(*args, jax.device_put(probe))
    jax.tree.map(lambda a, b: assert_close(a, b, F32_LOOSE), got, want)


@jax.jit  # one jitted function: traced once per shape, however many tests call it
def reference_grads(params, x, probe):
    """The plain-jnp dense reference's gradients of sum(y * probe), drop-free top-2."""

    def ref_loss(params, x):
        return jnp.sum(jnp_reference(params, x, top_k=2, capacity_factor=None) * probe)

    return jax.grad(ref_loss, argnums=(0, 1))(params, x)


def test_dispatch_config_errors_name_the_field():
    from axplug.api.config import ConfigError

    with pytest.raises(ConfigError, match=r"dispatch\.tile_size: 0 must be >= 1"):
        balanced(0.5, 0).instantiate(parent=None)
    with pytest.raises(ConfigError, match=r"dispatch\.buffer_factor: 0.0 must be > 0"):
        balanced(0.0, 128).instantiate(parent=None)
    # Runs saved before the tile was fixed hold tile_size None: 128, at most the choices.
    legacy = BalancedDispatch.default_config().set(tile_size=None).instantiate(parent=None)
    assert (legacy.tile(1000), legacy.tile(40)) == (128, 40)


# ----------------------------------------------------------- whole presets, per token


class TokenLoopDispatch(Dispatch):
    """Plain-jnp reference: for one token at a time (`lax.map`), its k experts' FFNs on it,
    summed with its gates. Shares nothing with the plugin's dispatches."""

    def forward(self, x, routing, experts):
        g, s, d = x.shape
        k = routing.expert_index.shape[-1]

        def one(args):
            v, index, gates = args
            up = jnp.einsum("d,kdh->kh", v, experts.wi_up[index])
            if experts.wi_gate is not None:
                h = jax.nn.silu(jnp.einsum("d,kdh->kh", v, experts.wi_gate[index])) * up
            else:
                h = jax.nn.silu(up)
            return jnp.einsum("kh,khd,k->d", h, experts.wo[index], gates.astype(v.dtype))

        rows = (x.reshape(g * s, d), routing.expert_index.reshape(g * s, k))
        return jax.lax.map(one, (*rows, routing.combine_weights.reshape(g * s, k))).reshape(g, s, d)


# The shipped drop-free preset with the most choices per token (64 experts, top-8): its
# overflow and buffer both run in a train step. A second preset (moe-tiny made drop-free: 8
# experts, top-2) ran the same dispatch and step code at another width; the layer tests above
# hold the top-2 edges.
PRESETS = {
    "moe-fine-tiny": ("moe-fine-tiny", ()),
}


def train_losses(cfg, start=None, steps=3):
    """(the first state, on the host, and each step's metrics) of `steps` steps from `start`
    (default: fresh), kept on the host: copied from there for each trainer (a `jnp.copy`
    per leaf compiled a program per shape)."""
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    if start is None:
        start = jax.tree.map(np.array, jax.device_get(trainer.init_state()))
    return start, train_steps(trainer, steps, start)[1]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_train_drop_free_like_a_per_token_loop(tmp_path, name):
    preset, modifiers = PRESETS[name]
    # One of the preset's four layers: each layer's dispatch is the same program. Half the
    # tiny trainer's rows: the per-token loop's steps run in time linear in the tokens.
    cfg = tiny_trainer_config(tmp_path / "run", "model.decoder.transformer.num_layers=1",
                              "input.batch_size=4", preset=preset, modifiers=modifiers)  # fmt: skip
    layers = find_configs(cfg, MoEFeedForward)
    assert layers and all(c.router.capacity_factor is None for _, c in layers)
    reference = cfg.clone()
    for _, layer in find_configs(reference, MoEFeedForward):
        layer.dispatch = TokenLoopDispatch.default_config()
    first, got = train_losses(cfg)
    _, want = train_losses(reference, first)  # the same parameters: one init compiled
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        # No choice dropped, and the balanced dispatch really used both of its paths.
        assert a["moe/dropped_fraction"] == 0.0
        assert 0.0 < a["moe/overflow_fraction"] < 1.0
    print(name, [round(float(m["loss"]), 6) for m in got])

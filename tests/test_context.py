"""Invocation contexts: functional() is pure under JAX transforms; keys follow child names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.api import ParameterSpec
from axplug.config import REQUIRED, Required, config_class
from axplug.context import (
    ContextError,
    add_module_output,
    add_summary,
    current_context,
    functional,
)
from axplug.layers import BaseLayer


class Scale(BaseLayer):
    """x * w, reporting an aux loss and a state update."""

    @config_class
    class Config(BaseLayer.Config):
        dim: Required[int] = REQUIRED

    def _create_layer_parameter_specs(self):
        return {
            "w": ParameterSpec(
                (self._config.dim,), jnp.float32, ("embed",), jax.nn.initializers.normal(1.0)
            )
        }

    def forward(self, x):
        w = self.parameters["w"]
        add_module_output("aux_loss", jnp.sum(w**2))  # the free function, from any depth
        self.add_state_update("calls", jnp.ones(()))
        return x * w


class Noise(BaseLayer):
    """x + N(0, 1) noise drawn from this module's key."""

    def forward(self, x):
        add_summary("input_mean", jnp.mean(x))
        return x + jax.random.normal(self.prng_key, x.shape)


class Parent(BaseLayer):
    @config_class
    class Config(BaseLayer.Config):
        dim: int = 3
        children_order: tuple[str, ...] = ("scale", "noise")
        noise_calls: int = 1

    def __init__(self, cfg, *, parent=None):
        super().__init__(cfg, parent=parent)
        for name in cfg.children_order:
            if name.startswith("scale"):
                self._add_child(name, Scale.default_config().set(dim=cfg.dim))
            else:
                self._add_child(name, Noise.default_config())

    def forward(self, x):
        assert current_context().module is self
        x = self.scale(x)
        for _ in range(self._config.noise_calls):
            x = self.noise(x)
        return jnp.sum(x)


def build(**kw):
    return Parent.default_config().set(**kw).instantiate()


def run(model, params, x, key=None):
    key = jax.random.PRNGKey(1) if key is None else key
    return functional(model, prng_key=key, state=params, inputs=(x,), is_training=True)


@pytest.fixture()
def setup():
    model = build()
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jnp.arange(6.0).reshape(2, 3)
    return model, params, x


def test_collection_holds_summaries_outputs_and_state_updates(setup):
    model, params, x = setup
    out, coll = run(model, params, x)
    assert out.shape == ()
    np.testing.assert_allclose(
        coll.summaries["noise"]["input_mean"], jnp.mean(x * params["scale"]["w"]), rtol=1e-6
    )
    np.testing.assert_allclose(
        coll.module_outputs["scale"]["aux_loss"], jnp.sum(params["scale"]["w"] ** 2), rtol=1e-6
    )
    assert float(coll.state_updates["scale"]["calls"]) == 1.0


def test_functional_under_jit_matches_eager(setup):
    model, params, x = setup
    eager = run(model, params, x)
    jitted = jax.jit(lambda p, x: run(model, p, x))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, jitted)


def test_functional_under_grad_matches_analytic(setup):
    model, params, x = setup
    grads = jax.grad(lambda p: run(model, p, x)[0])(params)
    # d/dw sum(x * w + noise) = sum over the batch of x
    np.testing.assert_allclose(grads["scale"]["w"], jnp.sum(x, axis=0), rtol=1e-6)


def test_functional_under_vmap_matches_a_loop(setup):
    model, params, x = setup
    xs = jnp.stack([x, 2 * x, -x])
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    batched, coll = jax.vmap(lambda x, k: run(model, params, x, k))(xs, keys)
    for i in range(3):
        single, _ = run(model, params, xs[i], keys[i])
        np.testing.assert_allclose(batched[i], single, rtol=1e-6)
    assert coll.summaries["noise"]["input_mean"].shape == (3,)


def test_functional_under_scan_matches_a_loop(setup):
    model, params, x = setup
    keys = jax.random.split(jax.random.PRNGKey(4), 4)

    def body(total, key):
        out, coll = run(model, params, x, key)
        return total + out, coll.module_outputs["scale"]["aux_loss"]

    total, aux = jax.lax.scan(body, 0.0, keys)
    expected = sum(run(model, params, x, k)[0] for k in keys)
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    assert aux.shape == (4,)


def test_functional_under_checkpoint_gives_same_grads(setup):
    model, params, x = setup
    loss = lambda p: run(model, p, x)[0]  # noqa: E731
    plain = jax.grad(loss)(params)
    remat = jax.grad(jax.checkpoint(loss))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), plain, remat)


def test_functional_inside_custom_vjp(setup):
    model, params, x = setup

    @jax.custom_vjp
    def f(p):
        return run(model, p, x)[0]

    def fwd(p):
        out, vjp = jax.vjp(lambda q: run(model, q, x)[0], p)
        return out, vjp

    def bwd(vjp, g):
        (grad,) = vjp(2.0 * g)  # a doubled gradient proves this backward pass ran
        return (grad,)

    f.defvjp(fwd, bwd)
    grads = jax.grad(f)(params)
    np.testing.assert_allclose(grads["scale"]["w"], 2.0 * jnp.sum(x, axis=0), rtol=1e-6)
    np.testing.assert_allclose(f(params), run(model, params, x)[0], rtol=1e-6)


def test_child_keys_depend_on_names_not_on_siblings():
    x = jnp.ones((2, 3))
    a = build(children_order=("scale", "noise"))
    b = build(children_order=("scale_extra", "scale", "noise"))
    pa = a.initialize_parameters_recursively(jax.random.PRNGKey(0))
    pb = b.initialize_parameters_recursively(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(pa["scale"]["w"], pb["scale"]["w"])
    assert not np.allclose(pb["scale_extra"]["w"], pb["scale"]["w"])
    # Noise drawn by `noise` is the same whatever siblings exist (scale_extra is unused).
    out_a, _ = run(a, pa, x)
    out_b, _ = run(b, pb, x)
    np.testing.assert_allclose(out_a, out_b, rtol=1e-6)
    out_c, _ = run(a, pa, x, jax.random.PRNGKey(2))
    assert not np.allclose(out_a, out_c)


def test_repeated_child_calls_get_fresh_keys_and_separate_outputs(setup):
    _, params, x = setup
    model = build(noise_calls=2)
    once, _ = run(build(), params, x)
    twice, coll = run(model, params, x)
    assert set(coll.summaries) == {"noise", "noise#1"}
    # The second call draws different noise, so the sum moves away from one-call's.
    assert not np.allclose(twice - once, 0.0)


def test_duplicate_outputs_in_one_call_are_errors(setup):
    class Twice(Noise):
        def forward(self, x):
            self.add_summary("s", 1.0)
            self.add_summary("s", 2.0)
            return x

    m = Twice.default_config().instantiate()
    with pytest.raises(ContextError, match="summary 's' was already added"):
        functional(m, prng_key=None, state={}, inputs=(jnp.ones(1),), is_training=False)


def test_state_and_outputs_need_a_context(setup):
    model, params, x = setup
    with pytest.raises(ContextError, match=r"model\.scale: state, keys and outputs"):
        model.scale.parameters  # noqa: B018
    with pytest.raises(ContextError, match="needs an invocation context"):
        add_summary("x", 1.0)
    with pytest.raises(ContextError, match="functional\\(\\) was given None"):
        functional(model, prng_key=None, state=params, inputs=(x,), is_training=False)


def test_calling_a_module_from_a_non_ancestor_fails(setup):
    model, params, x = setup

    class Intruder(BaseLayer):
        def forward(self, x):
            return model.noise(x)

    intruder = Intruder.default_config().instantiate()
    with pytest.raises(ContextError, match="model.noise was called from model"):
        functional(
            intruder, prng_key=jax.random.PRNGKey(0), state={}, inputs=(x,), is_training=False
        )


def test_ancestor_may_call_a_grandchild_directly():
    class Grand(BaseLayer):
        def __init__(self, cfg, *, parent=None):
            super().__init__(cfg, parent=parent)
            self._add_child("inner", Parent.default_config())

        def forward(self, x):
            return self.inner.scale(x)  # skips `inner`'s own method

    g = Grand.default_config().instantiate()
    params = g.initialize_parameters_recursively(jax.random.PRNGKey(0))
    x = jnp.ones((1, 3))
    out, coll = functional(g, prng_key=None, state=params, inputs=(x,), is_training=False)
    np.testing.assert_allclose(out, x * params["inner"]["scale"]["w"])
    assert "aux_loss" in coll.module_outputs["inner"]["scale"]

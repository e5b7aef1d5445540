"""Batched parameter initialization (axplug.layers.initialize) against one draw per parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug.context import name_hash
from axplug.layers import CausalLM, ParameterSpec
from axplug.layers.base import BaseLayer
from axplug.modifiers import make_modifier
from axplug.testing import production_compiler_options


def one_draw_each(layer, key):
    """The definition: each parameter's initializer called with the key folded from the names
    on its path, one call per parameter (a layer with its own method calls it)."""
    if (
        type(layer).initialize_parameters_recursively
        is not BaseLayer.initialize_parameters_recursively
    ):
        return layer.initialize_parameters_recursively(key)
    params = {
        name: spec.initializer(jax.random.fold_in(key, name_hash(name)), spec.shape, spec.dtype)
        for name, spec in layer._create_layer_parameter_specs().items()
    }
    for name, child in layer._children.items():
        child_key = jax.random.fold_in(key, name_hash(name))
        if hasattr(child, "initialize_parameters_recursively") and (
            sub := one_draw_each(child, child_key)
        ):
            params[name] = sub
    return params


def tiny_lm(*modifiers):
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=61, dim=32)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg.instantiate(parent=None)


def random_calls(fn, key) -> int:
    """How many key folds and bit draws `fn` traces to (each a threefry hash to compile)."""
    jaxpr = str(jax.make_jaxpr(fn)(key))
    return jaxpr.count("random_fold_in") + jaxpr.count("random_bits")


@pytest.mark.parametrize("modifiers", [(), ("scan_layers",)], ids=["unrolled", "scanned"])
def test_batched_draws_equal_one_draw_per_parameter(modifiers):
    model = tiny_lm(*modifiers)
    key = jax.random.PRNGKey(7)
    # Exact under the compiler users run; the session's loop emitters round erf_inv's output
    # differently batched and alone (1 ulp).
    options = dict(compiler_options=production_compiler_options())
    got = jax.jit(model.initialize_parameters_recursively, **options)(key)
    want = jax.jit(lambda k: one_draw_each(model, k), **options)(key)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # A few batched draws instead of one per parameter and per tree node (a scanned stack's
    # layer is one vmapped subtree either way).
    batched = random_calls(model.initialize_parameters_recursively, key)
    each = random_calls(lambda k: one_draw_each(model, k), key)
    assert batched * (1 if modifiers else 3) < each, (batched, each)


def test_an_initializer_that_captures_an_array_draws_alone():
    table = np.arange(12, dtype=np.float32).reshape(3, 4)

    def from_table(key, shape, dtype):
        return jnp.asarray(table, dtype) + jax.random.normal(key, shape, dtype)

    class Two(BaseLayer):
        def _create_layer_parameter_specs(self):
            spec = ParameterSpec((3, 4), jnp.float32, (None, None), from_table)
            return {"a": spec, "b": spec}

    cfg = Two.default_config().set(name="two")
    layer = cfg.instantiate(parent=None)
    key = jax.random.PRNGKey(1)
    jax.tree.map(
        np.testing.assert_array_equal,
        layer.initialize_parameters_recursively(key),
        one_draw_each(layer, key),
    )

"""axplug.layers.grouped_init: a model's parameters drawn one vmapped call per repeated spec
equal the per-parameter draws (to float32 rounding: the compiler fuses the two programs
differently), in a smaller program; a subtree's own `initialize_parameters` and an
initializer it cannot compare are respected."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from axplug.layers import CausalLM, Linear
from axplug.layers.grouped_init import initialize_grouped
from axplug.modifiers import make_modifier


def _model(*modifiers, layers=3):
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=61, dim=32)
    cfg.decoder.transformer.set(num_layers=layers)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    for spec in modifiers:
        cfg = make_modifier(spec)(cfg)
    return cfg.instantiate(parent=None)


def _draws(fn, keys) -> int:
    """How many random-bit draws (call sites, nested calls included) the program makes."""

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name in ("random_bits", "threefry2x32")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, ClosedJaxpr):
                        n += count(sub.jaxpr)
                    elif isinstance(sub, Jaxpr):
                        n += count(sub)
        return n

    return count(jax.make_jaxpr(fn)(keys).jaxpr)


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_an_unrolled_stack_draws_each_layer_spec_once_and_the_same_values():
    model = _model()
    keys = jax.device_get(model.parameter_keys(jax.random.PRNGKey(0)))
    grouped = jax.jit(lambda k: initialize_grouped(model, k))
    _assert_same(grouped(keys), jax.jit(model.initialize_parameters)(keys))
    # One per random parameter (3 layers x 7, the embedding, the head), against one per spec:
    # q/k/v, the attention output, the two feed-forward inputs, and the feed-forward output of
    # every layer, the embedding and the head.
    assert _draws(model.initialize_parameters, keys) == 23
    assert _draws(lambda k: initialize_grouped(model, k), keys) == 6


def test_a_scanned_stack_keeps_its_own_initialization():
    model = _model("scan_layers")
    keys = jax.device_get(model.parameter_keys(jax.random.PRNGKey(1)))
    grouped = lambda k: initialize_grouped(model, k)  # noqa: E731
    assert jax.eval_shape(grouped, keys) == jax.eval_shape(model.initialize_parameters, keys)
    # The stack's vmapped draws as they were: one per spec of its layer, nothing regrouped.
    assert _draws(grouped, keys) == _draws(model.initialize_parameters, keys) == 9


def test_an_initializer_it_cannot_compare_is_drawn_alone():
    table = np.linspace(-1.0, 1.0, 32 * 32, dtype=np.float32)

    def from_table(key, shape, dtype):  # closes over an array: unhashable, so not grouped
        return (jnp.asarray(table).reshape(shape) + jax.random.normal(key, shape)).astype(dtype)

    model = _model(layers=2)
    for layer in ("layer0", "layer1"):
        linear = model.decoder.transformer._children[layer].attention.output
        assert isinstance(linear, Linear)
        weight = linear._create_layer_parameter_specs()["weight"]
        linear._create_layer_parameter_specs = lambda w=weight: {
            "weight": dataclasses.replace(w, initializer=from_table)
        }
    keys = jax.device_get(model.parameter_keys(jax.random.PRNGKey(2)))
    grouped = lambda k: initialize_grouped(model, k)  # noqa: E731
    assert jax.eval_shape(grouped, keys) == jax.eval_shape(model.initialize_parameters, keys)
    # q/k/v, the feed-forward inputs, its output, the embedding and the head grouped; the two
    # attention outputs alone.
    assert _draws(grouped, keys) == 7 and _draws(model.initialize_parameters, keys) == 16

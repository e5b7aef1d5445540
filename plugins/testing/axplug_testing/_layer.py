"""`LayerConformance`: the checks every layer plugin should pass, as one class to subclass."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axplug_testing._util import TraceCounter, assert_finite, require, sum_of_squares

__all__ = ["LAYER_CAPABILITIES", "LayerConformance"]


def _assert_trees_close(got: Any, want: Any, tolerance: dict, what: str) -> None:
    """Compares two pytrees leaf by leaf; a failure names the leaf's path."""
    keys = jax.tree_util.keystr
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    got_leaves = dict(jax.tree_util.tree_leaves_with_path(got))
    assert sorted(map(keys, got_leaves)) == sorted(map(keys, want_leaves)), (
        f"{what}: the trees differ in structure"
    )
    for path, value in got_leaves.items():
        np.testing.assert_allclose(
            np.asarray(value, np.float32),
            np.asarray(want_leaves[path], np.float32),
            **tolerance,
            err_msg=f"{what}{keys(path)}",
        )


def _fingerprint(tree: Any) -> tuple:
    """A key for a pytree's structure and values (the fixtures make new, equal arrays per test)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    digest = [(a.shape, str(a.dtype), hashlib.sha1(a.tobytes()).hexdigest()) for a in arrays]
    return str(treedef), tuple(digest)


# What one conformance class's checks share (pytest makes an instance per check): its layer and
# parameters, initialized once, and its one-device jitted forward, compiled once. Keyed by the
# class, the layer's config and the inputs' values; only the latest class's are kept.
_SHARED: dict[Any, Any] = {}


# What a layer may declare in `capabilities`; checks for undeclared ones are skipped with why.
LAYER_CAPABILITIES = (
    "differentiable",  # gradients of a loss of its outputs are finite (and not all zero)
    "shardable",  # 8-device sharded forward (and gradients, if differentiable) equal 1-device
    "swappable",  # replacing `swap_target` in `swap_preset` trains for a few steps
)


class LayerConformance:
    """Subclass as `TestMyLayer(LayerConformance)` and override `layer_config` (required).

    Optional fixtures: `input_shape` (default [4, 8, input_dim]), `inputs` (positional tuple or
    keyword dict for `forward`; any pytree of arrays: each leaf is sharded along its batch
    dim in the sharding check), `swap_target` (the class in the preset `swap_preset` this
    layer replaces; the default, the core FeedForward, is taken only for a layer whose config
    has the FeedForward's required fields, so a norm or attention plugin must name its own),
    `swap_modifier` (returns a function cfg -> cfg that puts the layer into a config tree;
    the default replaces every `swap_target` with `replace_config`), `tolerance`,
    `mesh_shape`. `swap_preset` is the core's gpt-tiny; a layer that replaces what only a
    plugin's preset has names that preset (installed with the plugin's test dependencies).
    """

    capabilities: tuple[str, ...] = LAYER_CAPABILITIES
    swap_preset: str = "gpt-tiny"
    train_steps: int = 2

    # -- fixtures an author overrides ------------------------------------------------------

    @pytest.fixture
    def layer_config(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `layer_config` fixture to return your "
            "layer's config, e.g. MyLayer.default_config().set(input_dim=16)"
        )

    @pytest.fixture
    def input_shape(self, layer_config) -> tuple[int, ...]:
        dim = getattr(layer_config, "input_dim", None)
        if not isinstance(dim, int):
            raise NotImplementedError(
                f"{type(self).__name__}: the config has no int input_dim; override `input_shape` "
                "or `inputs`"
            )
        return (4, 8, dim)

    @pytest.fixture
    def inputs(self, input_shape) -> Any:
        # Drawn with numpy: jax.random run op by op would compile a program per new shape.
        x = np.random.default_rng(1).standard_normal(input_shape).astype(np.float32)
        return (jnp.asarray(x),)

    @pytest.fixture
    def swap_target(self, layer_config):
        from axplug.config import REQUIRED
        from axplug.layers import FeedForward

        needed = [k for k, v in FeedForward.default_config().items() if v is REQUIRED]
        fields = set(layer_config.keys())
        missing = [k for k in needed if k not in fields]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__}: the default swap_target is the core FeedForward, but "
                f"this layer's config lacks its required fields {missing}, so it is not a "
                "feed-forward layer; override the `swap_target` fixture with the class it "
                "replaces in its swap_preset (e.g. LayerNorm for a norm)"
            )
        return FeedForward

    @pytest.fixture
    def swap_modifier(self, layer_config, swap_target):
        """cfg -> cfg putting this layer in place of every `swap_target` of a config tree."""
        from axplug.config import replace_config

        new_cfg = layer_config.clone(name=None)
        return lambda cfg: replace_config(cfg, target=swap_target, new_cfg=new_cfg)

    @pytest.fixture
    def tolerance(self) -> dict:
        # float32; sharded runs reduce in another order (see tests/test_trainer.py).
        return {"rtol": 2e-5, "atol": 2e-5}

    @pytest.fixture
    def mesh_shape(self) -> tuple[int, ...]:
        # (data, fsdp, expert, seq, model): data, FSDP and tensor parallelism at once.
        return (2, 2, 1, 1, 2)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def build(layer_config):
        """The layer instantiated as a root module."""
        cfg = layer_config.clone(name=layer_config.name or "layer")
        return cfg.instantiate(parent=None)

    @staticmethod
    def apply(layer, params, inputs, *, prng_key=None, is_training=False):
        from axplug.context import functional

        out, _ = functional(
            layer, prng_key=prng_key, state=params, inputs=inputs, is_training=is_training
        )
        return out

    def _shared(self, what: str, key: Any, make: Any) -> Any:
        if _SHARED.get("owner") is not type(self):
            _SHARED.clear()
            _SHARED["owner"] = type(self)
        if (what, key) not in _SHARED:
            _SHARED[what, key] = make()
        return _SHARED[what, key]

    def _layer_and_params(self, layer_config) -> tuple[Any, Any]:
        """(the layer, `initialize_parameters_recursively(PRNGKey(0))`): made once per config
        for the class's checks, which only read them."""

        def make():
            layer = self.build(layer_config)
            return layer, layer.initialize_parameters_recursively(jax.random.PRNGKey(0))

        return self._shared("params", (layer_config.klass, layer_config.debug_string()), make)

    def _one_device_forward(self, layer_config, inputs) -> tuple[Any, TraceCounter, Any]:
        """(the jitted inference forward on one device, its `TraceCounter`, its output on
        `inputs`): traced inside the sharding scope as the sharded check's runs are, and shared
        by the jit check and the sharded check (made once per config and inputs)."""
        from axplug.mesh import DEFAULT_AXIS_RULES
        from axplug.sharding import scoped

        layer, params = self._layer_and_params(layer_config)

        def make():
            counter = TraceCounter(lambda p, x: self.apply(layer, p, x))
            fn = jax.jit(scoped(counter, None, DEFAULT_AXIS_RULES))
            return fn, counter, fn(params, inputs)

        key = (layer_config.klass, layer_config.debug_string(), _fingerprint(inputs))
        return self._shared("forward", key, make)

    # -- the checks ------------------------------------------------------------------------

    def test_capabilities_are_known(self):
        unknown = set(self.capabilities) - set(LAYER_CAPABILITIES)
        assert not unknown, f"unknown capabilities {sorted(unknown)}; known: {LAYER_CAPABILITIES}"

    def test_config_round_trip(self, layer_config):
        from axplug.config import from_dict, to_dict

        data = to_dict(layer_config)
        again = from_dict(data, trusted=True)
        assert type(again) is type(layer_config)
        assert again.debug_string() == layer_config.debug_string(), "to_dict/from_dict lost fields"
        assert to_dict(again) == data
        lines = layer_config.debug_string().splitlines()
        assert lines, "debug_string() is empty"
        bad = [line for line in lines if ": " not in line]
        assert not bad, f"debug_string() lines must be `path: value`: {bad[:3]}"
        self.build(again)  # the round-tripped config still builds

    def test_parameter_specs_match_initialized_shapes(self, layer_config):
        from axplug.api import ParameterSpec
        from axplug.mesh import DEFAULT_AXIS_RULES

        layer, params = self._layer_and_params(layer_config)
        specs = layer.create_parameter_specs_recursively()
        is_spec = lambda s: isinstance(s, ParameterSpec)  # noqa: E731
        spec_paths = dict(jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec))
        param_paths = dict(jax.tree_util.tree_leaves_with_path(params))
        keys = jax.tree_util.keystr
        assert sorted(map(keys, spec_paths)) == sorted(map(keys, param_paths)), (
            "initialize_parameters_recursively() and create_parameter_specs_recursively() "
            "disagree on which parameters exist"
        )
        known = {name for name, _ in DEFAULT_AXIS_RULES}
        for path, spec in spec_paths.items():
            value = param_paths[path]
            where = f"params{keys(path)}"
            assert tuple(value.shape) == tuple(spec.shape), (
                f"{where}: initialized shape {value.shape} != spec shape {spec.shape}"
            )
            assert jnp.dtype(value.dtype) == jnp.dtype(spec.dtype), (
                f"{where}: initialized dtype {value.dtype} != spec dtype {spec.dtype}"
            )
            for axis in spec.mesh_axes:
                assert axis is None or axis in known, (
                    f"{where}: mesh axis {axis!r} is not a logical axis; use one of "
                    f"{sorted(known)} or None"
                )

    def test_jit_forward_traces_once(self, layer_config, inputs, tolerance):
        layer, params = self._layer_and_params(layer_config)
        fn, counter, out = self._one_device_forward(layer_config, inputs)
        assert_finite(out, "forward output")
        # New values of the same shapes and dtypes must reuse the compiled program (made on
        # the host: an eager op would compile a program per leaf shape).
        host = jax.device_get((params, inputs))
        fresh = jax.tree.map(
            lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.inexact) else x, host[1]
        )
        fn(params, fresh)
        fn(jax.tree.map(lambda p: p * np.asarray(0.5, p.dtype), host[0]), inputs)
        assert counter.count == 1, f"forward was traced {counter.count} times for one shape"
        eager = self.apply(layer, params, inputs)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tolerance), out, eager)

    def test_gradients_are_finite(self, layer_config, inputs):
        require(self, "differentiable", LAYER_CAPABILITIES)
        layer, params = self._layer_and_params(layer_config)

        def loss(p):
            return sum_of_squares(
                self.apply(layer, p, inputs, prng_key=jax.random.PRNGKey(2), is_training=True)
            )

        grads = jax.jit(jax.grad(loss))(params)
        assert_finite(grads, "grad")
        leaves = jax.tree.leaves(grads)
        if leaves:
            assert any(np.any(np.asarray(g) != 0) for g in leaves), "every gradient is zero"

    def test_sharded_matches_one_device(self, layer_config, inputs, mesh_shape, tolerance):
        """Forward outputs, and gradients when `differentiable`, on 8 devices vs on one."""
        require(self, "shardable", LAYER_CAPABILITIES)
        from jax.sharding import NamedSharding

        from axplug.mesh import (
            DEFAULT_AXIS_RULES,
            MeshBuilder,
            logical_to_partition_spec,
            parameter_shardings,
        )
        from axplug.sharding import scoped

        needed = math.prod(mesh_shape)
        if jax.device_count() < needed:
            pytest.skip(
                f"needs {needed} devices, found {jax.device_count()}; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={needed} before importing jax"
            )
        layer, params = self._layer_and_params(layer_config)
        key = jax.random.PRNGKey(2)
        mesh = MeshBuilder.default_config().set(mesh_shape=mesh_shape).instantiate()
        mesh = mesh.build(jax.devices()[:needed])
        rules = DEFAULT_AXIS_RULES

        def jitted(fn, mesh=None):
            # Sharded runs trace inside the sharding scope, as the Trainer's step does.
            return jax.jit(scoped(fn, mesh, rules))

        # The forward as the jit check runs it (no key: inference), whose one-device program
        # and output it shares; the gradients of a loss of the outputs.
        run = lambda p, x: self.apply(layer, p, x)  # noqa: E731
        loss = lambda p, x: sum_of_squares(self.apply(layer, p, x, prng_key=key))  # noqa: E731
        with_grads = "differentiable" in self.capabilities
        expected = self._one_device_forward(layer_config, inputs)[2]
        expected_grads = jitted(jax.grad(loss))(params, inputs) if with_grads else None
        forward, grad = jitted(run, mesh), jitted(jax.grad(loss), mesh)
        p_shard = parameter_shardings(layer.create_parameter_specs_recursively(), mesh, rules)
        # Laid out from host copies: a device array moved onto another sharding compiles a
        # program per shape.
        host_params, host_inputs = jax.device_get((params, inputs))
        sharded_params = jax.device_put(host_params, p_shard)

        def put(x):
            logical = ("batch",) + (None,) * (x.ndim - 1) if x.ndim else ()
            spec = logical_to_partition_spec(logical, rules, mesh, x.shape)
            return jax.device_put(x, NamedSharding(mesh, spec))

        sharded_inputs = jax.tree.map(put, host_inputs)
        got = forward(sharded_params, sharded_inputs)
        _assert_trees_close(got, expected, tolerance, "sharded forward output")
        if with_grads:
            got_grads = grad(sharded_params, sharded_inputs)
            _assert_trees_close(got_grads, expected_grads, tolerance, "sharded grad")

    def test_trains_in_the_swap_preset(self, layer_config, swap_modifier, tmp_path):
        require(self, "swappable", LAYER_CAPABILITIES)
        from axplug import registry
        from axplug_testing._trainer import tiny_trainer_config, train_steps

        preset = self.swap_preset
        try:
            registry.entry("presets", preset)
        except LookupError:
            pytest.skip(f"no installed plugin registers the {preset} preset")
        cfg = tiny_trainer_config(
            tmp_path,
            "learner.warmup_steps=0",
            "model.decoder.transformer.num_layers=1",
            "model.decoder.transformer.layer.attention.num_heads=4",
            "input.seq_len=16",
            "input.batch_size=2",
            "mesh.mesh_shape=(1, 1, 1, 1, 1)",
            preset=preset,
            max_steps=self.train_steps,
        )
        cfg = swap_modifier(cfg)
        from axplug.config import find_configs

        if not find_configs(cfg, layer_config.klass):
            raise AssertionError(
                f"{type(self).__name__}: swap_modifier left no {layer_config.klass.__name__} "
                f"in {preset}; it must put this layer into the config tree"
            )
        # The built train step, as a run calls it (no checkpoint or writer: not the layer's).
        _, metrics = train_steps(cfg.instantiate(devices=jax.devices()[:1]), self.train_steps)
        losses = [float(m["loss"]) for m in metrics]
        assert len(losses) == self.train_steps, losses
        assert all(math.isfinite(v) for v in losses), f"non-finite training loss: {losses}"

"""Stacks of transformer layers: unrolled, or one layer's parameters scanned with remat."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from axplug.config import REQUIRED, ConfigError, Required, config_class
from axplug.context import OutputCollection, functional, name_hash
from axplug.layers.base import BaseLayer, ParameterSpec
from axplug.layers.transformer import TransformerLayer
from axplug.module import Module

__all__ = [
    "StackedTransformer",
    "RepeatedTransformer",
    "REMAT_POLICIES",
    "remat_layer",
    "remat_children",
    "scan_layer",
    "merge_collections",
]


class _Stack(BaseLayer):
    """What an unrolled and a scanned stack share: config.json's `num_hidden_layers`, a count
    of transformer layers (a layer class's `hf_depth(cfg)` of them per unit of the stack)."""

    hf_role = "stack"  # an unrolled and a scanned stack compute the same thing

    @classmethod
    def hf_read(cls, cfg: Any, fields: Any) -> None:
        layers, per = fields.positive_int("num_hidden_layers"), _per_unit(cfg)
        if layers % per:
            fields.problem(
                f"{fields.name('num_hidden_layers')}={layers} is not a multiple of the {per} "
                f"layers of each {cfg.layer.klass.__name__} of the stack"
            )
        cfg.num_layers = layers // per

    @classmethod
    def hf_write(cls, cfg: Any) -> dict:
        return {"num_hidden_layers": cfg.num_layers * _per_unit(cfg)}


def _per_unit(cfg: Any) -> int:
    """Transformer layers per unit of a stack (its layer class's `hf_depth`)."""
    return max(1, int(cfg.layer.klass.hf_depth(cfg.layer)))


class StackedTransformer(_Stack):
    """`num_layers` independent children layer0..layerN-1, applied in order (unrolled)."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_layers: Required[int] = REQUIRED
        layer: BaseLayer.Config = TransformerLayer.default_config()

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        for i in range(cfg.num_layers):
            self._add_child(f"layer{i}", cfg.layer.clone(input_dim=cfg.input_dim))

    def forward(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        for i in range(self._config.num_layers):
            x = getattr(self, f"layer{i}")(x, **kwargs)
        return x

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache per layer, keyed like the layers' parameters."""
        return {
            f"layer{i}": getattr(self, f"layer{i}").init_cache_state(batch_size, max_len)
            for i in range(self._config.num_layers)
        }

    def extend_step(
        self, x: jax.Array, *, positions: jax.Array, cache_state: dict
    ) -> tuple[jax.Array, dict]:
        """`forward` for new tokens through every layer's cache; (output, new cache)."""
        new_cache = {}
        for i in range(self._config.num_layers):
            name = f"layer{i}"
            x, new_cache[name] = getattr(self, name).extend_step(
                x, positions=positions, cache_state=cache_state[name]
            )
        return x, new_cache


def _offload(*names: str):
    """Recompute everything except `names`, which go to pinned host memory and back."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


# Names of TransformerLayer activations: layer_input, attention_output, feed_forward_output.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
    # Offload: device memory of full remat, less recompute; the copies overlap compute on
    # accelerators with host DMA engines.
    "offload": _offload("layer_input"),
    "offload_outputs": _offload("layer_input", "attention_output", "feed_forward_output"),
}


class RepeatedTransformer(_Stack):
    """One `layer` child whose parameters carry a leading `layers` axis, run by lax.scan.

    Compile time stays flat in depth; `remat_policy` picks what the backward pass recomputes.
    Outputs of the layer (summaries, aux losses) come back stacked along the layer axis.
    """

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        num_layers: Required[int] = REQUIRED
        layer: BaseLayer.Config = TransformerLayer.default_config()
        remat_policy: str = "none"

    def __init__(self, cfg: Config, *, parent: Module | None = None):
        super().__init__(cfg, parent=parent)
        if cfg.remat_policy not in REMAT_POLICIES:
            raise ConfigError(
                f"{self.path}.remat_policy: unknown policy {cfg.remat_policy!r}; "
                f"choose from {sorted(REMAT_POLICIES)}"
            )
        self._add_child("layer", cfg.layer.clone(input_dim=cfg.input_dim))

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        n = self._config.num_layers

        def stacked(spec: ParameterSpec) -> ParameterSpec:
            return dataclasses.replace(
                spec, shape=(n, *spec.shape), mesh_axes=("layers", *spec.mesh_axes)
            )

        specs = self.layer.create_parameter_specs_recursively()
        return {
            "layer": jax.tree.map(stacked, specs, is_leaf=lambda s: isinstance(s, ParameterSpec))
        }

    def parameter_keys(self, prng_key: jax.Array) -> dict[str, Any]:
        key = jax.random.fold_in(prng_key, name_hash("layer"))
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(self._config.num_layers))
        return {"layer": jax.vmap(self.layer.parameter_keys)(keys)}

    def initialize_parameters(self, keys: dict[str, Any]) -> dict[str, Any]:
        return {"layer": jax.vmap(self.layer.initialize_parameters)(keys["layer"])}

    def forward(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        ctx = self._context()
        layer_ctx = ctx.add_child("layer")
        n = self._config.num_layers
        keys = None
        if layer_ctx.has_prng_key:
            base = layer_ctx.prng_key
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n))
        x, stacked = scan_layer(
            self.layer, layer_ctx.state, x, kwargs, keys, ctx.is_training, self._config.remat_policy
        )
        merge_collections(layer_ctx.output_collection, stacked)
        return x

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """The layer's empty decoding cache, stacked along a leading `layers` axis."""
        one = self.layer.init_cache_state(batch_size, max_len)
        n = self._config.num_layers
        return {"layer": jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), one)}

    def extend_step(
        self, x: jax.Array, *, positions: jax.Array, cache_state: dict
    ) -> tuple[jax.Array, dict]:
        """`forward` for new tokens, scanning the layer over its stacked parameters and
        caches; (output, new cache). Summaries of decoding steps are not collected."""
        layer_ctx = self._context().add_child("layer")

        def body(carry, xs):
            params, cache = xs
            (out, new_cache), _ = functional(
                self.layer,
                prng_key=None,
                state=params,
                inputs={"x": carry, "positions": positions, "cache_state": cache},
                is_training=False,
                method="extend_step",
            )
            return out, new_cache

        x, new_cache = jax.lax.scan(body, x, (layer_ctx.state, cache_state["layer"]))
        return x, {"layer": new_cache}


def remat_layer(
    layer: Module,
    params: Any,
    x: jax.Array,
    kwargs: dict,
    key: jax.Array | None,
    is_training: bool,
    remat_policy: str,
    *,
    prevent_cse: bool = True,
) -> tuple[jax.Array, OutputCollection]:
    """`layer` applied once to `x` with `params`, under jax.checkpoint with `remat_policy`
    ("none": no checkpoint); (output, the layer's outputs). `prevent_cse=False` only inside
    a scan (jax.checkpoint's advice)."""

    def call(x, params, key):
        return functional(
            layer,
            prng_key=key,
            state=params,
            inputs=(x,) if not kwargs else {"x": x, **kwargs},
            is_training=is_training,
        )

    if remat_policy != "none":
        call = jax.checkpoint(call, policy=REMAT_POLICIES[remat_policy], prevent_cse=prevent_cse)
    return call(x, params, key)


def remat_children(
    module: Module,
    names: list[str],
    x: jax.Array,
    kwargs: dict,
    remat_policy: str,
    *,
    prevent_cse: bool = True,
) -> jax.Array:
    """`module`'s children `names` applied in order to `x` (inside its forward), each under
    jax.checkpoint with `remat_policy` ("none": called plainly); their outputs collected."""
    if remat_policy == "none":
        for name in names:
            x = getattr(module, name)(x, **kwargs)
        return x
    ctx = module._context()
    for name in names:
        child = ctx.add_child(name)
        key = child.prng_key if child.has_prng_key else None
        x, outputs = remat_layer(
            getattr(module, name),
            child.state,
            x,
            kwargs,
            key,
            ctx.is_training,
            remat_policy,
            prevent_cse=prevent_cse,
        )
        merge_collections(child.output_collection, outputs)
    return x


def scan_layer(
    layer: Module,
    params: Any,
    x: jax.Array,
    kwargs: dict,
    keys: jax.Array | None,
    is_training: bool,
    remat_policy: str,
) -> tuple[jax.Array, OutputCollection]:
    """`layer` applied once per slice of `params`' leading axis, by lax.scan with remat;
    (output, the layer's outputs stacked along that axis)."""

    def body(carry, xs):
        layer_params, key = xs
        return remat_layer(
            layer, layer_params, carry, kwargs, key, is_training, remat_policy, prevent_cse=False
        )

    return jax.lax.scan(body, x, (params, keys))


def merge_collections(target: OutputCollection, source: OutputCollection) -> None:
    """Adds `source`'s summaries, state updates and module outputs into `target`'s."""
    for dst, src in zip(target, source, strict=True):
        dst.update(src)

"""Many LoRA adapters over one base model at once: each adapted Linear holds a table of adapter
slots, and each row of a batch reads its own (`Request.adapter`, the layer's side input
`adapter`), so requests for different adapters share one decode step."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api import ParameterSpec
from axplug.api.config import REQUIRED, ConfigError, Required, config_class, find_configs, visit
from axplug.api.layers import BaseLayer, Linear, side_input
from axplug_lora.layer import LoRAAdapter

__all__ = ["AdapterTable", "LoRAWeights", "adapted_linears", "linears_of", "lora_weights",
           "read_adapter", "with_table", "write_slot"]  # fmt: skip

_LEAVES = (".adapter.lora_a", ".adapter.lora_b")


class AdapterTable(BaseLayer):
    """`slots` low-rank adapters of one Linear, stacked: `lora_a` [slots + 1, in, rank] and
    `lora_b` [slots + 1, rank, out], the scale folded into `lora_b`; entry 0 stays zero (a row
    with no adapter). Row i of the input reads entry `side_input("adapter")[i]`: a gathered
    low-rank product per row (punica's BGMV), so a batch mixes adapters. Without the side
    input (every row on the base) it adds nothing and computes nothing."""

    @config_class
    class Config(BaseLayer.Config):
        input_dim: Required[int] = REQUIRED
        output_dim: Required[int] = REQUIRED
        mesh_axes: tuple[str | None, str | None] = ("embed", "mlp")
        slots: int = 4
        rank: int = 16  # the largest adapter rank it takes (smaller ones padded with zeros)
        modules: tuple[str, ...] | None = None  # as LoRAAdapter's: the Linears that get one

    applies_to = LoRAAdapter.applies_to

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        cfg = self._config
        axis_in, axis_out = cfg.mesh_axes
        zeros = jax.nn.initializers.zeros
        entries = cfg.slots + 1
        return {
            "lora_a": ParameterSpec(shape=(entries, cfg.input_dim, cfg.rank), dtype=self.dtype,
                                    mesh_axes=(None, axis_in, None), initializer=zeros),
            "lora_b": ParameterSpec(shape=(entries, cfg.rank, cfg.output_dim), dtype=self.dtype,
                                    mesh_axes=(None, None, axis_out), initializer=zeros),
        }  # fmt: skip

    def forward(self, x: jax.Array) -> jax.Array:
        rows = side_input("adapter")
        if rows is None:
            return jnp.zeros((), x.dtype)
        if x.shape[0] != rows.shape[0]:
            raise ValueError(
                f"{self.path}: the side input `adapter` has {rows.shape[0]} rows, the input "
                f"{x.shape[0]}; an adapter table needs one adapter per row of its input"
            )
        a = self.cast(self.parameters["lora_a"])[rows]  # [rows, in, rank]
        b = self.cast(self.parameters["lora_b"])[rows]  # [rows, rank, out]
        low = jnp.einsum("b...i,bir->b...r", self.cast(x), a)
        return jnp.einsum("b...r,bro->b...o", low, b)


@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """A LoRA run's adapters, read without its base: `weights` by parameter path
    (`...adapter.lora_a` [..., in, rank], `...adapter.lora_b` [..., rank, out] times the
    scale), the Linears they adapt (`adapted_linears`), and the base they were trained over
    (the run's `frozen` metadata: `from`, `step`, `digest`)."""

    run: str
    step: int
    rank: int
    weights: dict[str, np.ndarray]
    linears: dict[str, tuple[str, ...] | None]
    base: dict | None


def adapted_linears(model_cfg: Any) -> dict[str, tuple[str, ...] | None]:
    """Config path of each Linear holding a LoRAAdapter -> the modules it adapts (None: all)."""
    found: dict[str, tuple[str, ...] | None] = {}

    def collect(path: str, value: Any) -> None:
        klass = getattr(value, "klass", None)
        linear = isinstance(klass, type) and issubclass(klass, Linear)
        if linear and value.adapter and issubclass(value.adapter.klass, LoRAAdapter):
            found[path] = value.adapter.modules

    visit(model_cfg, collect)
    return found


def linears_of(adapters: list[LoRAWeights]) -> dict[str, tuple[str, ...] | None]:
    """The Linears any of `adapters` adapts (`adapted_linears`), each with the union of their
    modules (None: all): what a table must hold for all of them."""
    linears: dict[str, tuple[str, ...] | None] = {}
    for adapter in adapters:
        for path, modules in adapter.linears.items():
            known = linears.get(path, ())
            both = None if modules is None or known is None else {*known, *modules}
            linears[path] = None if both is None else tuple(sorted(both))
    return linears


def read_adapter(run: str | os.PathLike, step: int | None = None) -> LoRAWeights:
    """The adapters of the LoRA run at `run` (its latest step by default), read alone."""
    from axplug.api.checkpoint import (
        FROZEN_KEY,
        Checkpointer,
        checkpoint_directory,
        restore_params,
    )
    from axplug.api.config import from_dict
    from axplug.api.interop import flatten, unflatten

    run = os.fspath(run)
    if not os.path.isdir(run):
        raise ConfigError(f"{run}: no such run directory")
    with Checkpointer.default_config().set(directory=checkpoint_directory(run)).instantiate() as ck:
        step = ck.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"{run}: no complete checkpoint; give a run trained with "
                              "--modifier lora")  # fmt: skip
        metadata = ck.metadata(step)
        cfg = from_dict(metadata["config"])
        _setting(run, cfg.model)
        model = cfg.model.instantiate(parent=None, _path="model")
        abstract = flatten(jax.eval_shape(model.initialize_parameters_recursively,
                                          jax.random.PRNGKey(0)))  # fmt: skip
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = unflatten({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device)
                            for k, v in abstract.items() if k.endswith(_LEAVES)})  # fmt: skip
        params = restore_params(ck, step, target)
    return lora_weights(cfg.model, params, run=run, step=step, base=metadata.get(FROZEN_KEY))


def lora_weights(model_cfg: Any, params: dict, *, run: str = "adapter", step: int = 0,
                 base: dict | None = None) -> LoRAWeights:  # fmt: skip
    """The LoRAWeights of a model with LoRA adapters (`params`: its tree, or its adapters')."""
    from axplug.api.interop import flatten

    rank, alpha = _setting(run, model_cfg)
    flat = flatten(jax.device_get(params))
    weights = {k: np.asarray(v, np.float32) * (alpha / rank if k.endswith("lora_b") else 1.0)
               for k, v in flat.items() if k.endswith(_LEAVES)}  # fmt: skip
    return LoRAWeights(run, step, rank, weights, adapted_linears(model_cfg), base)


def _setting(run: str, model_cfg: Any) -> tuple[int, float]:
    """The (rank, alpha) of every LoRA adapter of `model_cfg`, or a ConfigError."""
    settings = {(c.rank, c.alpha) for _, c in find_configs(model_cfg, LoRAAdapter)}
    if not settings:
        raise ConfigError(f"{run}: its model has no LoRA adapters (train it with "
                          "--modifier lora)")  # fmt: skip
    if len(settings) > 1:
        raise ConfigError(f"{run}: its adapters have different rank/alpha {sorted(settings)}; "
                          "serve it merged (--merge-adapters) on a server of its own")  # fmt: skip
    return next(iter(settings))


def with_table(
    model_cfg: Any, params: dict, linears: dict[str, tuple[str, ...] | None], *, slots: int,
    rank: int, mesh: Any, axis_rules: Any,
) -> tuple[Any, dict, set[str]]:  # fmt: skip
    """(model config, parameters, table leaf paths) of the model with an `AdapterTable` of
    `slots` adapters of rank at most `rank` on each Linear of `linears` (config path ->
    modules, as `adapted_linears` gives), every slot empty; the parameters on `mesh`."""
    from axplug.api.interop import flatten, unflatten
    from axplug.api.sharding import parameter_shardings

    if slots < 1 or rank < 1:
        raise ConfigError(f"an adapter table needs slots >= 1 and rank >= 1, got {slots}, {rank}")
    cfg = model_cfg.clone()
    found = []

    def place(path: str, value: Any) -> None:
        if path in linears:
            value.adapter = AdapterTable.default_config().set(slots=slots, rank=rank,
                                                              modules=linears[path])  # fmt: skip
            found.append(path)

    visit(cfg, place)
    if missing := sorted(set(linears) - set(found)):
        raise ConfigError(f"the served model has no Linear at {missing[0]} for an adapter")
    model = cfg.instantiate(parent=None, _path="model")
    specs = model.create_parameter_specs_recursively()
    shardings = flatten(parameter_shardings(specs, mesh, axis_rules))
    abstract = flatten(jax.eval_shape(model.initialize_parameters_recursively,
                                      jax.random.PRNGKey(0)))  # fmt: skip
    flat = flatten(params)
    table = {k for k in abstract if k not in flat}
    for key in table:  # host zeros: no program per shape
        flat[key] = jax.device_put(np.zeros(abstract[key].shape, abstract[key].dtype),
                                   shardings[key])  # fmt: skip
    return cfg, unflatten(flat), table


def write_slot(params: dict, table: set[str], slot: int, adapter: LoRAWeights | None) -> dict:
    """`params` with entry `slot` of every table leaf (`with_table`) set to `adapter`'s
    weights (zero-padded to the table's rank; zeros where it adapts nothing, or for None)."""
    from axplug.api.interop import flatten, unflatten

    flat = flatten(params)
    rank = next(flat[k].shape[-1] for k in table if k.endswith("lora_a"))
    if adapter is not None:
        if extra := sorted(set(adapter.weights) - table):
            raise ConfigError(
                f"{adapter.run}: adapts {extra[0].rsplit('.', 2)[0]}, which no adapter table "
                "holds; give it at start-up so that the tables include that Linear"
            )
        if adapter.rank > rank:
            raise ConfigError(f"{adapter.run}: rank {adapter.rank} exceeds the tables' {rank}")
    for key in table:
        leaf = flat[key]
        entry = np.zeros(leaf.shape[:-3] + leaf.shape[-2:], np.float32)
        if adapter is not None and key in adapter.weights:
            value = adapter.weights[key]
            at = (..., slice(None), slice(0, value.shape[-1])) if key.endswith("a") else (
                ..., slice(0, value.shape[-2]), slice(None))  # fmt: skip
            if entry[at].shape != value.shape:
                raise ConfigError(f"{adapter.run}: {key} is {value.shape}, the served model's "
                                  f"table takes {entry.shape}: another base model")  # fmt: skip
            entry[at] = value
        flat[key] = _set_entry(leaf, np.int32(slot), entry.astype(leaf.dtype))
    return unflatten(flat)


@jax.jit  # the slot traced: one program per table shape, whichever slot is written
def _set_entry(leaf: jax.Array, slot: jax.Array, entry: jax.Array) -> jax.Array:
    return leaf.at[..., slot, :, :].set(entry)

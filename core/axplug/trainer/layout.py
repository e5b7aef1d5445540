"""How the training state and the input batches are laid out over the mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from axplug.config import ConfigError
from axplug.input import batch_shape
from axplug.sharding import ShardingScope
from axplug.trainer.trainable import pick

__all__ = ["StateLayout", "check_input_split"]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """A run's train state `{"params", "opt_state", "step"}`: its abstract arrays (each with its
    sharding) and shardings, the optimizer sizing its state, and which parameters the optimizer
    sees, which are frozen and which a checkpoint stores (each mask None: every parameter)."""

    abstract: dict
    shardings: dict
    tx: optax.GradientTransformation
    optimizer_mask: Any = None
    frozen_mask: Any = None
    stored_mask: Any = None

    @classmethod
    def build(
        cls, tx: optax.GradientTransformation, abstract_params: Any, param_shardings: Any,
        masks: tuple[Any, Any, Any] = (None, None, None),
    ) -> StateLayout:  # fmt: skip
        """The state of `tx` over the parameters: `masks` are `trainable.frozen_masks`'."""
        shardings, abstract = _state_layout(tx, abstract_params, param_shardings, masks[0])
        return cls(abstract, shardings, tx, *masks)

    def init_opt_state(self, params: Any) -> Any:
        """A fresh optimizer state for `params` (of the parameters the optimizer updates)."""
        return self.tx.init(pick(self.optimizer_mask, params))

    def init_state(self, model: Any, seed: int) -> dict:
        """Fresh parameters of `model` (from `seed`) and optimizer state, laid out."""

        def init(keys):
            params = model.initialize_parameters(keys)
            step = jnp.zeros((), jnp.int32)
            return {"params": params, "opt_state": self.init_opt_state(params), "step": step}

        # The keys op by op (one small program, reused), outside the program that draws the
        # parameters: in it, each of their ~100 hashes compiled as its own loop (2.4 s of a
        # tiny LLaMA init's compile, more than its train step's).
        keys = jax.device_get(model.parameter_keys(jax.random.PRNGKey(seed)))
        return jax.jit(init, out_shardings=self.shardings)(keys)

    def fresh_opt_state(self, params: Any) -> Any:
        """`init_opt_state(params)` laid out as the run lays out its optimizer state."""
        return jax.jit(self.init_opt_state, out_shardings=self.shardings["opt_state"])(params)


def _state_layout(
    tx: optax.GradientTransformation,
    abstract_params: Any,
    param_shardings: Any,
    optimizer_mask: Any | None,
):
    """(shardings, abstract sharded state) of `{"params", "opt_state", "step"}`; the
    optimizer state covers the parameters `optimizer_mask` selects (None: all)."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, pick(optimizer_mask, abstract_params))

    def like_param(state, sharding, param):
        if isinstance(state, optax.MaskedNode):  # the other part of a partitioned optimizer
            return state
        # Moments shaped like their parameter share its layout; factored ones (adafactor's
        # row and column statistics) are replicated.
        return sharding if state.shape == param.shape else replicated

    opt_shardings = optax.tree_map_params(
        tx,
        like_param,
        abstract_opt,
        pick(optimizer_mask, param_shardings),
        pick(optimizer_mask, abstract_params),
        transform_non_params=lambda _: replicated,
        is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    )
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract = {
        "params": abstract_params,
        "opt_state": abstract_opt,
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    return shardings, jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def check_input_split(
    input_cfg: Any, scope: ShardingScope | None, grad_accumulation_steps: int
) -> None:
    """A batch (and each accumulated microbatch) and a sequence that the mesh splits evenly:
    a dim the mesh axes do not divide would be silently replicated instead (no mesh: none)."""
    if scope is None:
        return
    batch, seq_len = batch_shape(input_cfg) or (None, None)
    axes = scope.spec(("batch",))[0]
    names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
    shards = scope.axis_size("batch")
    if isinstance(batch, int) and batch % shards:
        raise input_cfg.field_error(
            "batch_size",
            f"{batch} rows cannot be split evenly over the {shards} devices of the batch mesh "
            f"axes {names}; use a multiple of {shards}, or a mesh with fewer devices on those axes",
        )
    k = grad_accumulation_steps
    if isinstance(batch, int) and k > 1 and (batch // k) % shards:
        raise ConfigError(
            f"learner.grad_accumulation_steps: {k} microbatches of {batch // k} rows cannot "
            f"be split over the {shards} devices of the batch mesh axes {names}; use "
            f"{input_cfg.field_path('batch_size')} a multiple of {k * shards}"
        )
    ways = scope.axis_size("seq")
    if isinstance(seq_len, int) and seq_len % ways:
        raise input_cfg.field_error(
            "seq_len",
            f"{seq_len} tokens cannot be split over the {ways} devices of the `seq` mesh axis; "
            f"use a multiple of {ways}",
        )

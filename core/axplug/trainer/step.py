"""The pure training step: loss + aux losses, gradient accumulation, optax update, NaN guard."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from axplug.config import ConfigValueError
from axplug.context import functional
from axplug.module import Module
from axplug.sharding import scoped
from axplug.trainer.aux_losses import AuxLossRule
from axplug.trainer.trainable import merge, optimizer_mask, pick, update_kinds

__all__ = [
    "GUARDS",
    "build_train_step",
    "build_eval_step",
    "guard_for",
    "jit_steps",
    "model_inputs",
    "forward_arguments",
    "step_key",
    "summary_scalars",
]

TrainState = dict[str, Any]  # {"params", "opt_state", "step"}


_STANDARD_INPUTS = ("input_ids", "target_labels", "positions", "segment_ids")


def forward_arguments(model: Module) -> tuple[str, ...] | None:
    """The keyword arguments `model.forward` takes (None: any, it has `**kwargs`)."""
    parameters = inspect.signature(type(model).forward).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return tuple(p.name for p in parameters if p.name != "self")


def model_inputs(batch: dict, accepted: tuple[str, ...] | None = _STANDARD_INPUTS) -> dict:
    """The model's keyword arguments from a batch: the entries its forward takes (`accepted`,
    from `forward_arguments`; None: all). By default ids, labels, and a packed batch's
    `positions` and `segment_ids`; an input may add more (a data directory's per-token
    values, e.g. reference log-probabilities), which reach a model that takes them."""
    return {k: v for k, v in batch.items() if accepted is None or k in accepted}


def step_key(seed: int, step: jax.Array) -> jax.Array:
    """The PRNG key of a step: a function of (seed, step) only, so resumed runs replay it."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def summary_scalars(collection) -> dict[str, Any]:
    """The layers' `add_summary` values as metrics.

    A summary named `name` is `summary/<module path>/<name>`; one named `group/name` (a
    router's `router/dropped_fraction`) is `group/name`, averaged over every module that
    records it. A scalar is its value; an array (per expert, or per layer of a scanned stack)
    is its mean, its max under `.../max`, and the array itself under `histograms` for the
    writers that draw distributions.
    """
    grouped: dict[str, list[jax.Array]] = {}
    out: dict[str, Any] = {}
    histograms: dict[str, jax.Array] = {}

    def visit(tree: dict, path: str) -> None:
        for name, value in tree.items():
            if isinstance(value, dict):
                visit(value, f"{path}/{name}")
            elif "/" in name:
                grouped.setdefault(name, []).append(jnp.asarray(value, jnp.float32))
            else:
                add(f"summary{path}/{name}", jnp.asarray(value, jnp.float32))

    def add(metric: str, value: jax.Array) -> None:
        out[metric] = jnp.mean(value)
        if value.size > 1:
            out[f"{metric}/max"] = jnp.max(value)
            histograms[metric] = value

    visit(collection.summaries, "")
    for name, values in grouped.items():
        add(name, values[0] if len(values) == 1 else jnp.concatenate([v.ravel() for v in values]))
    if histograms:
        out["histograms"] = histograms
    return out


def loss_fn(model: Module, aux_rule: AuxLossRule):
    """The training loss: `(params, batch, key) -> (total loss, (metrics, state updates))`."""
    accepted = forward_arguments(model)

    def total_loss(params, batch, key):
        (loss, _), collection = functional(
            model,
            prng_key=key,
            state=params,
            inputs=model_inputs(batch, accepted),
            is_training=True,
        )
        aux_total, aux_terms = aux_rule(collection.module_outputs)
        metrics = {"ce_loss": loss, **aux_terms, **summary_scalars(collection)}
        return loss + aux_total, (metrics, collection.pruned().state_updates)

    return total_loss


def _grad_fn(loss_fn, kinds: Any):
    """`jax.value_and_grad(loss_fn)`, differentiating only the leaves that are not frozen
    (their gradients are None): a frozen weight's gradient is never computed."""
    if "frozen" not in jax.tree.leaves(kinds):
        return jax.value_and_grad(loss_fn, has_aux=True)
    live_mask = jax.tree.map(lambda kind: kind != "frozen", kinds)

    def value_and_grad(params, batch, key):
        def of_live(live):
            return loss_fn(merge(live_mask, live, params), batch, key)

        return jax.value_and_grad(of_live, has_aux=True)(pick(live_mask, params))

    return value_and_grad


def _split_non_trainable(kinds: Any, grads: Any) -> tuple[Any, Any]:
    """(gradients with non-trainable leaves zeroed, the `gradient` leaves' new values);
    frozen leaves have no gradient (None)."""

    def trained_only(kind, g):
        if kind == "frozen":
            return None
        return g if kind == "optimizer" else jnp.zeros_like(g)

    trained = jax.tree.map(trained_only, kinds, grads)
    overwrite = jax.tree.map(lambda kind, g: g if kind == "gradient" else None, kinds, grads)
    return trained, overwrite


def _non_trainable_values(kinds: Any, new: Any, old: Any, updates: dict, overwrite: Any) -> Any:
    """The optimizer's `new` params, except `state` leaves: the recorded update (else the
    `old` value), `gradient` leaves: their gradient, and `frozen` leaves: the `old` value."""

    def visit(kind, new, old, update, overwrite):
        if isinstance(kind, dict):
            update = update if isinstance(update, dict) else {}
            return {
                name: visit(kind[name], new[name], old[name], update.get(name), overwrite[name])
                for name in kind
            }
        if kind == "state":
            value = old if update is None else update
            return jnp.asarray(value, old.dtype).reshape(old.shape)
        if kind == "gradient":
            return overwrite.astype(old.dtype)
        if kind == "frozen":
            return old
        return new

    return visit(kinds, new, old, updates, overwrite)


def _split_microbatches(batch: dict, k: int) -> dict:
    def split(x):
        if x.shape[0] % k:
            raise ConfigValueError(
                f"learner.grad_accumulation_steps: batch size {x.shape[0]} is not divisible "
                f"by grad_accumulation_steps={k}"
            )
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])

    return jax.tree.map(split, batch)


GUARDS = ("cond", "select")


def guard_for(platform: str, guard: str = "auto") -> str:
    """The non-finite guard a step on `platform` uses: `guard`, or for "auto" a branch on
    CPU (an XLA:CPU select is not fused into the update: +2.3% bytes accessed on
    a tiny LLaMA; the branch adds 4 KB) and a select elsewhere (XLA:GPU copies the state into
    a branch: +4.9% bytes on an H200)."""
    if guard == "auto":
        return "cond" if platform == "cpu" else "select"
    return guard


def build_train_step(
    model: Module,
    tx: optax.GradientTransformation,
    aux_rule: AuxLossRule,
    *,
    seed: int,
    grad_accumulation_steps: int = 1,
    learning_rate: Callable[[jax.Array], jax.Array] | None = None,
    trainable: str | None = None,
    guard: str = "cond",
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """`step(state, batch) -> (state, metrics)`; a non-finite loss or gradient leaves the
    parameters and optimizer state unchanged and reports `finite=False`.

    `guard` is how: "cond" branches around the update (XLA:CPU reads no more bytes than an
    unguarded step; XLA:GPU copies the state into the branch); "select" always computes the
    update and keeps each old value where the step is not finite, an elementwise select the
    update's fusions absorb on XLA:GPU / TPU (`GUARDS`, `guard_for`).

    `trainable` (`learner.trainable`) freezes the parameters whose path it does not match:
    `tx` and the state's `opt_state` then cover the others only (`trainable.pick`)."""
    kinds = update_kinds(model.create_parameter_specs_recursively(), trainable)
    opt_mask = optimizer_mask(kinds)
    grad_fn = _grad_fn(loss_fn(model, aux_rule), kinds)
    tx = optax.with_extra_args_support(tx)
    has_non_trainable = any(k != "optimizer" for k in jax.tree.leaves(kinds))

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        params, key = state["params"], step_key(seed, state["step"])
        # With accumulation, state updates and overwriting gradients are averaged over the
        # microbatches like the gradients.
        if grad_accumulation_steps == 1:
            (total, (terms, updates)), grads = grad_fn(params, batch, key)
        else:
            micro = _split_microbatches(batch, grad_accumulation_steps)

            def accumulate(carry, xs):
                i, mb = xs
                (t, aux), g = grad_fn(params, mb, jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, carry, (t, aux, g)), None

            (t0, aux0), g0 = jax.eval_shape(
                grad_fn, params, jax.tree.map(lambda x: x[0], micro), key
            )
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (t0, aux0, g0))
            idx = jnp.arange(grad_accumulation_steps)
            summed, _ = jax.lax.scan(accumulate, zeros, (idx, micro))
            total, (terms, updates), grads = jax.tree.map(
                lambda x: x / grad_accumulation_steps, summed
            )
        overwrite = None
        if has_non_trainable:
            grads, overwrite = _split_non_trainable(kinds, grads)
        grad_norm = optax.tree_utils.tree_norm(grads)
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)

        # The norm goes to the optimizer's clipping (axplug.learner.clip_by_global_norm;
        # other transformations ignore it), so the gradients are read for it once.
        def apply(grads, opt_state, params):
            deltas, new_opt_state = tx.update(
                pick(opt_mask, grads), opt_state, pick(opt_mask, params), grad_norm=grad_norm
            )
            trained = optax.apply_updates(pick(opt_mask, params), deltas)
            new_params = merge(opt_mask, trained, params)
            if has_non_trainable:
                new_params = _non_trainable_values(kinds, new_params, params, updates, overwrite)
            return new_params, new_opt_state

        def skip(grads, opt_state, params):
            return params, opt_state

        if guard == "cond":
            new_params, new_opt_state = jax.lax.cond(
                finite, apply, skip, grads, state["opt_state"], params
            )
        else:
            new_params, new_opt_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old),
                apply(grads, state["opt_state"], params),
                (params, state["opt_state"]),
            )
        new_state = {"params": new_params, "opt_state": new_opt_state, "step": state["step"] + 1}
        metrics = {"loss": total, **terms, "grad_norm": grad_norm, "finite": finite}
        if learning_rate is not None:
            metrics["learning_rate"] = learning_rate(state["step"])
        return new_state, metrics

    return step


def build_eval_step(model: Module) -> Callable[[Any, dict], jax.Array]:
    """`eval_step(params, batch) -> mean cross-entropy loss` in inference mode."""
    accepted = forward_arguments(model)

    def eval_step(params, batch):
        (loss, _), _ = functional(
            model,
            prng_key=None,
            state=params,
            inputs=model_inputs(batch, accepted),
            is_training=False,
        )
        return loss

    return eval_step


def jit_steps(
    train_step: Callable, model: Module, mesh: Any, rules: Any, state_shardings: dict,
    batch_sharding: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """(train step, eval step) jitted over `mesh` under the logical-axis `rules`: the state
    laid out by `state_shardings` (donated to the train step), the batch by `batch_sharding`,
    metrics and the eval loss replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    train = jax.jit(
        scoped(train_step, mesh, rules),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        scoped(build_eval_step(model), mesh, rules),
        in_shardings=(state_shardings["params"], batch_sharding),
        out_shardings=replicated,
    )
    return train, evaluate

"""Which parameters the optimizer updates: all, or those `learner.trainable` selects.

The selection is a mask over the parameter tree. The optimizer is built and initialized on
the selected leaves only (`pick`: the others are `None`, which optax and `jax.tree` skip), so
a frozen parameter has no optimizer state and no gradient; the train step puts the frozen
values back unchanged (`merge`).
"""

from __future__ import annotations

import re
from typing import Any

import jax

from axplug.api import ParameterSpec
from axplug.config import ConfigError

__all__ = [
    "parameter_paths",
    "update_kinds",
    "optimizer_mask",
    "frozen_masks",
    "pick",
    "merge",
]


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


def parameter_paths(tree: Any, *, is_leaf=None) -> Any:
    """The tree of each leaf's path, `decoder/transformer/layer0/attention/q_proj/weight`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "/".join(str(getattr(k, "key", k)) for k in path), tree, is_leaf=is_leaf
    )


def update_kinds(specs: Any, trainable: str | None) -> Any:
    """Each parameter's `ParameterSpec.update`, with `"frozen"` for an optimizer-updated
    parameter whose path `trainable` (a regex, searched) does not match.

    Raises the ConfigError naming `learner.trainable` when it matches no parameter."""
    kinds = jax.tree.map(lambda s: s.update, specs, is_leaf=_is_spec)
    if trainable is None:
        return kinds
    pattern = re.compile(trainable)
    paths = parameter_paths(specs, is_leaf=_is_spec)
    kinds = jax.tree.map(
        lambda kind, path: "frozen" if kind == "optimizer" and not pattern.search(path) else kind,
        kinds,
        paths,
    )
    if "optimizer" not in jax.tree.leaves(kinds):
        examples = ", ".join(jax.tree.leaves(paths)[:3])
        raise ConfigError(
            f"learner.trainable: {trainable!r} matches no trained parameter (paths look like "
            f"{examples}); fix the pattern, or set it to None to train every parameter"
        )
    return kinds


def optimizer_mask(kinds: Any) -> Any | None:
    """The leaves the optimizer sees (its state's shape); None: all of them (no freezing).

    Without frozen parameters every leaf goes through the optimizer as it always has (the
    `state`/`gradient` ones with zero gradients, their values overwritten after)."""
    if "frozen" not in jax.tree.leaves(kinds):
        return None
    return jax.tree.map(lambda kind: kind == "optimizer", kinds)


def frozen_masks(kinds: Any) -> tuple[Any | None, Any | None, Any | None]:
    """(optimizer mask, frozen mask, stored mask) of a run's update kinds: what the
    optimizer sees, what is frozen, and what a fine-tune's checkpoints store (the rest);
    all None without frozen parameters."""
    optimizer = optimizer_mask(kinds)
    if optimizer is None:
        return None, None, None
    frozen = jax.tree.map(lambda kind: kind == "frozen", kinds)
    return optimizer, frozen, jax.tree.map(lambda f: not f, frozen)


def pick(mask: Any | None, tree: Any) -> Any:
    """`tree` with the leaves `mask` leaves out as None (`tree` itself for no mask)."""
    if mask is None:
        return tree
    return jax.tree.map(lambda keep, x: x if keep else None, mask, tree)


def merge(mask: Any | None, picked: Any, full: Any) -> Any:
    """`full` with the leaves `mask` selects taken from `picked`."""
    if mask is None:
        return picked
    return jax.tree.map(lambda keep, p, f: p if keep else f, mask, picked, full)

"""Starting a run from another run's weights (fine-tuning): `Trainer.init_from`."""

from __future__ import annotations

import logging
from typing import Any

import jax

__all__ = ["restore_weights"]

log = logging.getLogger("axplug.trainer")


def _present(abstract: Any, saved: Any, new_ok: Any, path: str = "") -> tuple[Any, list, list]:
    """(`abstract` pruned to what `saved` holds, the dotted paths it lacks that `new_ok`
    (a tree of bools shaped like `abstract`) lets start fresh, those it does not)."""
    if not isinstance(abstract, dict):
        return abstract, [], []
    kept: dict = {}
    fresh: list[str] = []
    lacking: list[str] = []
    for key, value in abstract.items():
        where = f"{path}.{key}" if path else str(key)
        if not isinstance(saved, dict) or key not in saved:
            allowed = all(jax.tree.leaves(new_ok[key]))
            (fresh if allowed else lacking).append(where)
            continue
        kept[key], more_fresh, more_lacking = _present(value, saved[key], new_ok[key], where)
        fresh, lacking = fresh + more_fresh, lacking + more_lacking
    return kept, fresh, lacking


def _known(checkpointer: Any, step: int, params: dict, new_ok: Any) -> dict:
    """`params` without the leaves the source lacks when `new_ok` lets them start fresh
    (else whole: the restore's mismatch error names what differs)."""
    from axplug.checkpoint import FROZEN_KEY

    if checkpointer.metadata(step).get(FROZEN_KEY):  # a fine-tune of a fine-tune: its base
        return params  # holds the rest; restore_params reads both
    saved = checkpointer.saved_tree(step).get("params")
    known, fresh, lacking = _present(params, saved, new_ok)
    if fresh and not lacking:
        log.info("parameters new to this run (initialized fresh): %s", ", ".join(fresh))
        return known
    return params


def restore_weights(
    path: str,
    step: int | None,
    *,
    abstract_state: dict,
    optimizer: bool,
    new_ok: Any = None,
) -> tuple[int, dict, dict | None]:
    """(step, params, opt_state or None) of the run at `path` (latest step unless given).

    The parameters restore onto `abstract_state["params"]` (this run's mesh and shardings; a
    model whose parameters differ is an error naming them). With `optimizer` the optimizer
    state restores onto this run's layout too (the same learner: resumed moments); None when
    the step holds none (an import's fresh optimizer state). Without, only the parameters are
    read.

    `new_ok` (a params tree of bools) marks the parameters the source may lack (an adapter
    added to a base model): they are left out of the returned params, for the caller to
    initialize. Any other parameter the source lacks is the usual error naming it.
    """
    from axplug.checkpoint import Checkpointer, checkpoint_directory, restore_params
    from axplug.checkpoint.errors import CheckpointNotFoundError
    from axplug.trainer.fresh_optimizer import has_fresh_opt_state

    directory = checkpoint_directory(path)
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(
                f"init_from: no complete checkpoint in {directory}; give a run directory "
                "written by `axplug train` or `axplug import-hf`"
            )
        optimizer = optimizer and not has_fresh_opt_state(checkpointer.metadata(step))
        log.info("initializing from step %d of %s", step, directory)
        if optimizer:
            _, state, _ = checkpointer.restore(step, target=dict(abstract_state))
            return step, state["params"], state["opt_state"]
        params = abstract_state["params"]
        if new_ok is not None:
            params = _known(checkpointer, step, params, new_ok)
        return step, restore_params(checkpointer, step, params), None

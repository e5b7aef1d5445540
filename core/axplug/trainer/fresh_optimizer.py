"""Checkpoints that hold no optimizer state (`axplug import-hf`'s): their metadata says
`"opt_state": "fresh"`, and whoever needs the optimizer state creates it as `tx.init(params)`,
the state the import would have saved, on the devices where it is used."""

from __future__ import annotations

from typing import Any

from axplug.checkpoint import FROZEN_KEY, CheckpointError, prune, restore_params
from axplug.trainer.layout import StateLayout

__all__ = ["FRESH_OPT_STATE", "has_fresh_opt_state", "restore_train_state"]

# The metadata entry of a checkpoint saved as {"params", "step"}: its optimizer state is fresh.
FRESH_OPT_STATE = {"opt_state": "fresh"}


def has_fresh_opt_state(metadata: dict) -> bool:
    """Whether a checkpoint with this metadata was saved without its (fresh) optimizer state."""
    return metadata.get("opt_state") == FRESH_OPT_STATE["opt_state"]


def restore_train_state(
    checkpointer: Any, layout: StateLayout, step: int
) -> tuple[int, dict, dict]:
    """`(step, state, metadata)` of `checkpointer`'s `step` as a train state of `layout`; a
    step saved without optimizer state gets a fresh one (its params and step
    restored), a fine-tune's step its frozen parameters from the base its metadata names."""
    abstract = layout.abstract
    metadata = checkpointer.metadata(step)
    if metadata.get(FROZEN_KEY) is not None:  # the trained parameters; the frozen from the base
        if layout.stored_mask is None:
            raise CheckpointError(
                f"step {step} in {checkpointer.directory} stores only the parameters its run "
                "trained (learner.trainable), but this config trains every parameter; resume "
                "with the config it was trained with (config.txt beside it)"
            )
        params = restore_params(checkpointer, step, abstract["params"])
        present = prune(layout.stored_mask, abstract["params"])
        target = {**abstract, "params": present}
        step, state, metadata = checkpointer.restore(step, target=target)
        return step, {**state, "params": params}, metadata
    if not has_fresh_opt_state(metadata):
        return checkpointer.restore(step, target=abstract)
    target = {"params": abstract["params"], "step": abstract["step"]}
    step, saved, metadata = checkpointer.restore(step, target=target, partial=True)
    state = {**saved, "opt_state": layout.fresh_opt_state(saved["params"])}
    return step, state, metadata

"""Starting a run from another run's weights (fine-tuning): `Trainer.init_from`."""

from __future__ import annotations

import logging

__all__ = ["restore_weights"]

log = logging.getLogger("axplug.trainer")


def restore_weights(
    path: str, step: int | None, *, abstract_state: dict, optimizer: bool
) -> tuple[int, dict, dict | None]:
    """(step, params, opt_state or None) of the run at `path` (latest step unless given).

    The parameters restore onto `abstract_state["params"]` (this run's mesh and shardings; a
    model whose parameters differ is an error naming them). With `optimizer` the optimizer
    state restores onto this run's layout too (the same learner: resumed moments); None when
    the step holds none (an import's fresh optimizer state). Without, only the parameters are
    read.
    """
    from axplug.checkpoint import Checkpointer
    from axplug.checkpoint.errors import CheckpointNotFoundError
    from axplug.inference.loading import checkpoint_directory
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
        target = {"params": abstract_state["params"]}
        _, state, _ = checkpointer.restore(step, target=target, partial=True)
    return step, state["params"], None

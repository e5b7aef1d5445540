"""Starting a run from another run's weights (fine-tuning): `Trainer.init_from`."""

from __future__ import annotations

import logging
from typing import Any

import jax

__all__ = ["restore_weights"]

log = logging.getLogger("axplug.trainer")


def restore_weights(
    path: str, step: int | None, *, abstract_state: dict, param_specs: Any, optimizer: bool
) -> tuple[int, dict, dict | None]:
    """(step, params, opt_state or None) of the run at `path` (latest step unless given).

    The parameters restore onto `abstract_state["params"]` (this run's mesh and shardings; a
    model whose parameters differ is an error naming them). With `optimizer` the optimizer
    state restores onto this run's layout too (the same learner: resumed moments); without,
    it is read onto the host in the source learner's layout and dropped.
    """
    from axplug.checkpoint import Checkpointer
    from axplug.checkpoint.errors import CheckpointNotFoundError
    from axplug.config import from_dict
    from axplug.inference.loading import checkpoint_directory

    directory = checkpoint_directory(path)
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(
                f"init_from: no complete checkpoint in {directory}; give a run directory "
                "written by `axplug train` or `axplug import-hf`"
            )
        target = dict(abstract_state)
        if not optimizer:
            source = from_dict(checkpointer.metadata(step)["config"])
            tx = source.learner.instantiate().transform(param_specs, source.max_steps)
            host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            target["opt_state"] = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host),
                jax.eval_shape(tx.init, abstract_state["params"]),
            )
        log.info("initializing from step %d of %s", step, directory)
        _, state, _ = checkpointer.restore(step, target=target)
    return step, state["params"], state["opt_state"] if optimizer else None

"""The Orbax pieces of a `Checkpointer`: its async checkpointer, a failed save's cleanup, and
the item, placeholders and cut of a partial restore."""

from __future__ import annotations

import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_utils import construct_restore_args

from axplug.checkpoint import layout
from axplug.checkpoint.storage import Storage

__all__ = ["new_orbax", "remove_failed_save", "placeholders", "partial_item", "wanted"]

# How many times (0.05 s apart) a failed save's temporary directory is looked for and deleted.
_CLEANUP_POLLS = 60
# A replicated array is written by all its replicas, each a slice, only when each slice has at
# least this many bytes: slicing compiles a program per replica and shape (an 8-device save of
# 20 small replicated arrays compiled 160 programs, 4.6 CPU s, to write 50 KB).
_MIN_REPLICA_SLICE_BYTES = 1 << 20


class _Registry(ocp.type_handlers.TypeHandlerRegistry):
    """Orbax's type handlers, with jax.Arrays written by replicas only in slices worth it."""

    def __init__(self) -> None:
        store = getattr(
            ocp.type_handlers.get_type_handler(jax.Array), "_array_metadata_store", None
        )
        self._array = ocp.type_handlers.ArrayHandler(
            array_metadata_store=store,
            min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES,
        )

    def add(self, *args: Any, **kwargs: Any) -> None:
        ocp.type_handlers.register_type_handler(*args, **kwargs)

    def get(self, ty: Any) -> Any:
        is_array = isinstance(ty, type) and issubclass(ty, jax.Array)
        return self._array if is_array else ocp.type_handlers.get_type_handler(ty)

    def has(self, ty: Any) -> bool:
        return ocp.type_handlers.has_type_handler(ty)


def new_orbax(storage: Storage) -> ocp.AsyncCheckpointer:
    """Orbax's async checkpointer, committing the way `storage` needs."""
    atomicity = ocp.path.atomicity
    temporary_path_class = (
        atomicity.AtomicRenameTemporaryPath
        if storage.atomic_rename
        else atomicity.CommitFileTemporaryPath
    )
    # On object stores the step's directories are created before `save` returns: when
    # orbax creates them in the background and the store fails there, its other writer
    # threads wait for that signal for orbax's full 5-minute barrier timeout.
    async_options = ocp.options.AsyncOptions(
        create_directories_asynchronously=storage.atomic_rename
    )
    # The items (state/, metadata/) commit the same way as the step directory: orbax's
    # own default renames them unless the path is gs://.
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(
            temporary_path_class=temporary_path_class, async_options=async_options
        ),
        **{
            layout.STATE_ITEM: ocp.PyTreeCheckpointHandler(type_handler_registry=_Registry()),
            layout.METADATA_ITEM: ocp.JsonCheckpointHandler(),
            layout.CHECKSUMS_ITEM: ocp.JsonCheckpointHandler(),
        },
    )
    return ocp.AsyncCheckpointer(
        handler, temporary_path_class=temporary_path_class, async_options=async_options
    )


def remove_failed_save(storage: Storage, directory: str, step: int) -> None:
    """Deletes the temporary directories a failed save of `step` left; process 0 only."""
    if jax.process_index() != 0:
        return
    prefix = layout.step_dir_name(step) + "."  # orbax's `step_N.orbax-checkpoint-tmp...`
    # TensorStore's writer threads are not joined by orbax's close: a write in flight can
    # recreate the temporary directory after it is deleted. Delete until it stays gone.
    clean_checks = 0
    for _ in range(_CLEANUP_POLLS):
        try:
            leftovers = [n for n in storage.listdir(directory) if n.startswith(prefix)]
            for name in leftovers:
                storage.delete(storage.join(directory, name))
        except Exception:  # noqa: BLE001 - the save's own error is the one to report
            return
        clean_checks = clean_checks + 1 if not leftovers else 0
        if clean_checks == 3:
            return
        time.sleep(0.05)


def placeholders(tree: Any) -> Any:
    """`tree` with every leaf Orbax's placeholder: a subtree a partial restore skips."""
    return jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)


def partial_item(saved: Any, abstract: Any) -> tuple[Any, Any]:
    """(item, restore args) of a partial restore: `saved`'s tree with `abstract`'s leaves
    where it wants them and Orbax's placeholder elsewhere, at any depth of dicts."""
    item, args = {}, {}
    for key, value in saved.items():
        want = abstract.get(key) if isinstance(abstract, dict) else None
        if want is None:
            item[key] = args[key] = placeholders(value)
        elif isinstance(value, dict) and isinstance(want, dict):
            item[key], args[key] = partial_item(value, want)
        else:
            item[key], args[key] = want, construct_restore_args(want)
    return item, args


def wanted(tree: Any, abstract: Any) -> Any:
    """`tree` cut to the dict keys `abstract` has, at any depth."""
    if not isinstance(tree, dict) or not isinstance(abstract, dict):
        return tree
    return {k: wanted(v, abstract[k]) for k, v in tree.items() if k in abstract}

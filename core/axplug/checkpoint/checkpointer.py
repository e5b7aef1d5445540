"""`Checkpointer`: asynchronous Orbax saves of a training state, one directory per step."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_utils import construct_restore_args

from axplug.checkpoint import inventory, layout
from axplug.checkpoint._orbax import new_orbax, partial_item, remove_failed_save, wanted
from axplug.checkpoint._quiet import drop_orbax_error_logs, quiet_after_failed_save
from axplug.checkpoint._slow_save import SLOW_SAVE_WARNING_S, warn_if_slow
from axplug.checkpoint._tree import abstract_target, first_non_finite
from axplug.checkpoint.checksum import tree_checksums
from axplug.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from axplug.checkpoint.integrity import checksum_mismatch, first_line, layout_mismatch
from axplug.checkpoint.local_tier import LocalTier
from axplug.checkpoint.retention import apply_retention, check_retention
from axplug.checkpoint.storage import storage_for
from axplug.config import REQUIRED, Configurable, Required, config_class

__all__ = ["Checkpointer", "SLOW_SAVE_WARNING_S"]

log = logging.getLogger("axplug.checkpoint")


class Checkpointer(Configurable):
    """Saves and restores `(step, state, metadata)` under `directory/step_XXXXXXXX`.

    `save` returns once the arrays are copied off the device and writes in the background; the
    next `save`, `restore`, `wait_until_finished` or `close` waits for it. A step counts only
    when complete (orbax's `commit_success.txt` is present), so an interrupted save is never
    listed or restored. Old steps are deleted after each completed save, keeping the last
    `keep_last` plus every multiple of `keep_every`. Each save also writes a checksum of every
    state leaf (`axplug.checkpoint.checksum`); `restore` and `verify` check them, so a file
    changed after the save (bit rot, a partial copy) is an error, never silently restored.
    """

    @config_class
    class Config(Configurable.Config):
        directory: Required[str] = REQUIRED  # a path, or a URL such as s3://bucket/run/ckpt
        keep_last: int = 3
        keep_every: int | None = None  # also keep every step divisible by this, forever
        async_save: bool = True
        storage_options: dict | None = None  # keyword arguments of the storage backend
        # Target size of the files a save writes the arrays into (OCDBT data files). A file's
        # compressed bytes stay in host memory until it is written, so this bounds what a save
        # holds beyond the state; None: orbax's default, about 2 GiB a file.
        data_file_bytes: int | None = None
        # A second, fast tier on each host (off until `local.directory` is set).
        local: LocalTier.Config = LocalTier.default_config()

    def __init__(self, cfg: Checkpointer.Config):
        super().__init__(cfg)
        cfg = self._config
        check_retention(cfg)
        if cfg.data_file_bytes is not None and cfg.data_file_bytes < 1:
            raise cfg.field_error(
                "data_file_bytes", f"must be None or at least 1, got {cfg.data_file_bytes}"
            )
        self.directory: str = cfg.directory
        self.storage = storage_for(cfg.directory, cfg.storage_options)
        try:
            self.storage.check(cfg.directory)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint directory {cfg.directory} is not usable: {type(exc).__name__}: {exc}"
            ) from exc
        self._orbax = new_orbax(self.storage)
        self._pending: int | None = None  # step being written in the background
        self._closed = False
        drop_orbax_error_logs()
        local = cfg.local.instantiate()  # its settings are checked even while it is off
        self.local: LocalTier | None = local if cfg.local.directory is not None else None

    # -- listing -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending; partial and temporary saves are skipped."""
        return [info.step for info in self.step_infos() if info.complete]

    def step_infos(self, *, sizes: bool = False) -> list[inventory.StepInfo]:
        """Every step directory, complete or not (with size and time when `sizes`)."""
        return inventory.list_steps(self.storage, self.directory, sizes=sizes)

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _is_complete(self, name: str) -> bool:
        return self.storage.exists(self.storage.join(self.directory, name, layout.COMMIT_MARKER))

    def _step_url(self, step: int) -> str:
        return self.storage.join(self.directory, layout.step_dir_name(step))

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: Any, metadata: dict | None = None) -> None:
        """Starts saving `state` (a pytree of arrays) and JSON `metadata` as `step`.

        Returns once the arrays are off the device (at once written with `async_save=False`).
        Raises ValueError, writing nothing, when a float leaf holds NaN or inf.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise TypeError(f"step {step}: metadata must be a dict, got {type(metadata).__name__}")
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"step {step}: metadata is not JSON-serializable ({exc}); nothing was written"
            ) from None
        bad = first_non_finite(state)
        if bad is not None:
            raise ValueError(
                f"refusing to save step {step} to {self.directory}: state leaf {bad} has "
                "non-finite values (NaN or inf); nothing was written"
            )
        self.wait_until_finished()
        self._prepare_step_dir(step)
        args = ocp.args.Composite(
            **{
                # PyTree*, never Standard*, args for the state item: one orbax instance
                # takes only one handler type per item (a partial restore is PyTreeRestore).
                layout.STATE_ITEM: ocp.args.PyTreeSave(
                    state, ocdbt_target_data_file_size=self._config.data_file_bytes
                ),
                layout.METADATA_ITEM: ocp.args.JsonSave(metadata),
                layout.CHECKSUMS_ITEM: ocp.args.JsonSave(tree_checksums(state)),
            }
        )
        try:
            with warn_if_slow(self._step_url(step), step, "starting the save of"):
                self._orbax.save(self.storage.path(self._step_url(step)), args=args)
        except Exception as exc:
            self._save_failed(step)
            raise CheckpointError(
                f"saving step {step} to {self._step_url(step)} failed: {first_line(exc)}"
            ) from exc
        self._pending = step
        if not self._config.async_save:
            self.wait_until_finished()

    def _prepare_step_dir(self, step: int) -> None:
        name = layout.step_dir_name(step)
        url = self._step_url(step)
        try:
            complete = self._is_complete(name)
            # Leftover of an interrupted save of the same step, never committed. With several
            # processes only process 0 deletes (orbax's save barrier orders the writers after).
            if not complete and jax.process_index() == 0 and self.storage.exists(url):
                self.storage.delete(url)
        except Exception as exc:
            raise CheckpointError(
                f"saving step {step} to {url} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if complete:
            raise CheckpointError(
                f"step {step} already has a complete checkpoint in {self.directory}; save "
                "under a new step, or delete that one first"
            )

    def wait_until_finished(self) -> None:
        """Blocks until the background write (if any) is committed, then applies retention;
        waits for the local tier's write too (whose failure is logged, never raised)."""
        if self.local is not None:
            self.local.wait_until_finished()
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            with warn_if_slow(self._step_url(step), step, "waiting for the save of"):
                self._orbax.wait_until_finished()
        except Exception as exc:
            self._save_failed(step)
            raise CheckpointError(
                f"saving step {step} to {self._step_url(step)} failed: {first_line(exc)}"
            ) from exc
        try:
            cfg = self._config
            apply_retention(
                self.storage, self.directory, self.all_steps(), cfg.keep_last, cfg.keep_every
            )
        except Exception as exc:
            raise CheckpointError(
                f"step {step} is saved in {self.directory}, but deleting old steps failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _save_failed(self, step: int) -> None:
        """After a failed save: its echoes silenced, orbax's threads joined (a fresh
        checkpointer for the next save), its temporary directories removed."""
        quiet_after_failed_save()
        with contextlib.suppress(Exception):  # the save's own error is the one to report
            self._orbax.close()  # its other writer threads may still be creating files
        self._orbax = new_orbax(self.storage)
        remove_failed_save(self.storage, self.directory, step)

    def delete(self, step: int) -> None:
        """Deletes `step` (complete or not), its completion marker first."""
        self._check_open()
        self.wait_until_finished()
        if not inventory.delete_step(self.storage, self.directory, step):
            raise CheckpointNotFoundError(f"step {step} does not exist in {self.directory}")

    def uncommit(self, step: int) -> None:
        """Marks a complete `step` incomplete (its marker removed): listed and restored no more,
        replaced when that step is saved again. Process 0 only."""
        self._check_open()
        if jax.process_index() == 0:
            url = self.storage.join(self._step_url(step), layout.COMMIT_MARKER)
            if self.storage.exists(url):
                self.storage.delete(url)

    # -- restoring ---------------------------------------------------------------------------

    def restore(
        self, step: int | None = None, *, target: Any, partial: bool = False
    ) -> tuple[int, Any, dict]:
        """Reads `(step, state, metadata)`; `step=None` means the latest complete step.

        `target` is a pytree of `jax.ShapeDtypeStruct` (or arrays) whose shardings say where
        each restored array goes, so a state saved on one mesh restores onto another. The
        restored state has exactly `target`'s tree structure. With `partial`, `target` may
        leave out saved entries (inference: `{"params", "step"}` without the optimizer
        state), which are then not read at all.
        """
        self._check_open()
        self.wait_until_finished()
        step = self._resolve_step(step)
        abstract = abstract_target(target)
        saved = self._saved_tree(step)
        if shown := layout_mismatch(wanted(saved, abstract) if partial else saved, abstract):
            # Not corruption: a config that builds another model or optimizer.
            raise CheckpointError(
                f"step {step} in {self.directory} holds a different state than this config "
                f"builds ({shown}); resume with the config it was trained with (config.txt "
                "beside it), or train into another --output-dir"
            )
        treedef = jax.tree.structure(abstract)
        if partial:  # the saved tree, with Orbax's placeholder where nothing is wanted
            item, restore_args = partial_item(saved, abstract)
        else:
            item, restore_args = abstract, construct_restore_args(abstract)
        state_args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        args = ocp.args.Composite(
            **{
                layout.STATE_ITEM: state_args,
                layout.METADATA_ITEM: ocp.args.JsonRestore(),
            }
        )
        try:
            restored = self._orbax.restore(self.storage.path(self._step_url(step)), args=args)
            state = restored[layout.STATE_ITEM]
            if partial:
                state = wanted(state, abstract)
            state = jax.tree.unflatten(treedef, treedef.flatten_up_to(state))
        except Exception as exc:
            raise CheckpointCorruptError(
                f"cannot restore step {step} from {self.directory} into the given target: "
                f"{first_line(exc)}"
            ) from exc
        self._verify(step, tree_checksums(state))
        return step, state, restored[layout.METADATA_ITEM] or {}

    def verify(self, step: int) -> int | None:
        """Reads `step`'s state to host memory and checks every leaf against its saved
        checksum; returns the number of leaves checked (None: saved without checksums).
        Raises CheckpointCorruptError naming the step and leaves when one differs."""
        import numpy as np

        from axplug.checkpoint.checksum import host_checksums

        self._check_open()
        self.wait_until_finished()
        step = self._resolve_step(step)
        if self.saved_checksums(step) is None:
            return None
        path = self.storage.path(self.storage.join(self._step_url(step), layout.STATE_ITEM))
        to_host = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), self._saved_tree(step)
        )
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                state = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=to_host))
        except Exception as exc:
            raise CheckpointCorruptError(
                f"step {step} in {self.directory} cannot be read: {first_line(exc)}"
            ) from exc
        actual = host_checksums(state)
        self._verify(step, actual)
        return len(actual)

    def saved_tree(self, step: int | None = None) -> Any:
        """The array metadata tree of `step`'s state (default: the latest): its structure,
        shapes and dtypes, without reading arrays."""
        self._check_open()
        self.wait_until_finished()
        return self._saved_tree(self._resolve_step(step))

    def _saved_tree(self, step: int) -> Any:
        """The array metadata tree of `step`'s state (shapes and dtypes, no data)."""
        path = self.storage.path(self.storage.join(self._step_url(step), layout.STATE_ITEM))
        try:
            return ocp.PyTreeCheckpointHandler().metadata(path).tree
        except Exception as exc:
            raise CheckpointCorruptError(
                f"step {step} in {self.directory}: its array metadata cannot be read: "
                f"{first_line(exc)}"
            ) from exc

    def saved_checksums(self, step: int) -> dict[str, str] | None:
        """The leaf checksums written with `step`; None for a step saved before checksums."""
        return self._read_json(step, layout.CHECKSUMS_ITEM, "checksums", missing_ok=True)

    def _verify(self, step: int, actual: dict[str, str]) -> None:
        saved = self.saved_checksums(step)
        if saved is not None and (shown := checksum_mismatch(saved, actual)) is not None:
            raise CheckpointCorruptError(
                f"step {step} in {self.directory} fails verification: {shown} differ from "
                "what was saved; its files changed after the save (bit rot, a partial copy)"
            )

    def metadata(self, step: int | None = None) -> dict:
        """The JSON metadata saved with `step` (default: the latest), without reading arrays."""
        self._check_open()
        self.wait_until_finished()
        return self._read_json(self._resolve_step(step), layout.METADATA_ITEM, "metadata")

    def _read_json(self, step: int, item: str, what: str, *, missing_ok: bool = False) -> Any:
        """A JSON item of `step`; CheckpointCorruptError when it cannot be read."""
        url = self.storage.join(self._step_url(step), item, layout.METADATA_FILE)
        if missing_ok and not self.storage.exists(url):
            return None
        try:
            return json.loads(self.storage.read_text(url))
        except (OSError, ValueError) as exc:
            raise CheckpointCorruptError(
                f"step {step} in {self.directory}: its {what} cannot be read ({exc})"
            ) from exc

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(
                    f"no complete checkpoint in {self.directory} (nothing saved there yet, or "
                    "every save was interrupted)"
                )
            return steps[-1]
        if step not in steps:
            state = "incomplete" if self.storage.exists(self._step_url(step)) else "missing"
            listing = ", ".join(map(str, steps)) if steps else "none"
            raise CheckpointNotFoundError(
                f"step {step} is {state} in {self.directory}; complete steps: {listing}"
            )
        return step

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the pending save, then releases orbax's resources; idempotent."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._orbax.close()
            if self.local is not None:
                self.local.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpointer for {self.directory} is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

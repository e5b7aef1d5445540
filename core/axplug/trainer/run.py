"""`train(cfg)`: take the run directory's lease, write the effective config next to the run,
then train or resume."""

from __future__ import annotations

import contextlib
from typing import Any

from axplug.checkpoint import scheme_of, storage_for

__all__ = ["train", "write_config"]


def write_config(cfg: Any) -> str:
    """Writes `cfg.debug_string()` to OUTPUT_DIR/config.txt and returns its URL."""
    storage = storage_for(cfg.output_dir, getattr(cfg.checkpointer, "storage_options", None))
    url = storage.join(cfg.output_dir, "config.txt")
    storage.write_text(url, cfg.debug_string() + "\n")
    return url


def train(cfg: Any, *, hooks: tuple = ()) -> dict:
    """Trains the Trainer config `cfg` to its max_steps; returns the last step's metrics."""
    import jax

    from axplug.runtime import RunDirLock, StoreLease
    from axplug.trainer.trainer import summary_dir

    if jax.process_index() != 0:  # process 0 holds the lease and writes the shared files
        return _build(cfg, hooks).run()
    # The lease before anything is written (summary files open when the trainer is built):
    # an flock on the local directory (a bucket's local mirror), and for a bucket a lease
    # object in it as well.
    with contextlib.ExitStack() as leases:
        leases.enter_context(RunDirLock(summary_dir(cfg.output_dir)))
        if scheme_of(cfg.output_dir) != "file":
            options = getattr(cfg.checkpointer, "storage_options", None)
            storage = storage_for(cfg.output_dir, options)
            leases.enter_context(StoreLease(storage, cfg.output_dir.rstrip("/")))
        trainer = _build(cfg, hooks)  # bad configs and unreachable storage fail first
        write_config(cfg)
        return trainer.run()


def _build(cfg: Any, hooks: tuple) -> Any:
    """The trainer, built under a start-up watchdog: a plugin import that hangs is a hang."""
    import logging

    logging.getLogger("axplug.trainer").info("building the trainer")
    watchdog = cfg.watchdog.instantiate()
    watchdog.start_startup("building the trainer (importing plugins, tracing shapes)")
    try:
        return cfg.instantiate(hooks=hooks)
    finally:
        watchdog.stop()

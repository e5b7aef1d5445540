"""`train(cfg)`: take the run directory's lease, write the effective config next to the run,
then train or resume."""

from __future__ import annotations

import contextlib
from typing import Any

from axplug.checkpoint import scheme_of, storage_for
from axplug.trainer.compilation import compilation_cache

__all__ = ["train", "write_config", "model_changes", "versions"]


def write_config(cfg: Any, provenance: dict | None = None) -> str:
    """Writes OUTPUT_DIR/config.txt (`debug_string()`, to read) and OUTPUT_DIR/config.json
    (`{"config": to_dict(cfg), "provenance": ...}`: exact, `--config` loads it), every URI in
    them without its user info; returns the config.txt URL."""
    import datetime
    import json

    from axplug.config import strip_userinfo, to_dict

    storage = storage_for(cfg.output_dir, getattr(cfg.checkpointer, "storage_options", None))
    url = storage.join(cfg.output_dir, "config.txt")
    # No credentials in the run's files: a URI's `user:password@` is dropped (also from argv).
    storage.write_text(url, strip_userinfo(cfg.debug_string()) + "\n")
    record = {
        "config": to_dict(cfg),
        "provenance": {
            "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": versions(),
            **(provenance or {}),
        },
    }
    text = strip_userinfo(json.dumps(record, indent=1))
    storage.write_text(storage.join(cfg.output_dir, "config.json"), text)
    return url


def versions() -> dict[str, str]:
    """Versions of jax, the libraries a run depends on, and every axplug distribution."""
    import importlib_metadata

    from axplug.registry._component import distribution_key

    out = {}
    for dist in importlib_metadata.distributions():
        # Chosen by directory name: parsing every installed distribution's METADATA took
        # 70-130 ms of each run's start.
        key = distribution_key(dist)
        if key.startswith("axplug") or key in ("jax", "jaxlib", "optax", "orbax-checkpoint"):
            metadata = dist.metadata
            out[(metadata["Name"] or key).lower()] = metadata["Version"]
    return dict(sorted(out.items()))


def model_changes(saved: dict, current: dict, prefix: str = "model") -> list[str]:
    """`path: saved X, now Y` for each field where two `to_dict` model trees differ."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += model_changes(a, b, f"{prefix}.{key}")
        elif a != b:
            out.append(f"{prefix}.{key}: saved {a!r}, now {b!r}")
    return out


def _check_same_model(checkpointer: Any, cfg: Any) -> None:
    """A resumed run whose model config differs from its checkpoint's is refused: the old
    weights would silently run in another model."""
    from axplug.config import ConfigError, to_dict

    step = checkpointer.latest_step()
    if step is None:
        return
    saved = checkpointer.metadata(step).get("config", {}).get("model")
    if saved is None:
        return
    changes = model_changes(saved, to_dict(cfg.model))
    if changes:
        shown = "; ".join(changes[:5]) + (
            f"; and {len(changes) - 5} more" if len(changes) > 5 else ""
        )
        raise ConfigError(
            f"{cfg.output_dir} resumes from step {step}, whose model differs from this one "
            f"({shown}); train into a new --output-dir (or --from this run to fine-tune it), "
            "or pass --allow-config-change to resume anyway"
        )


def train(
    cfg: Any,
    *,
    hooks: tuple = (),
    provenance: dict | None = None,
    allow_config_change: bool = False,
) -> dict:
    """Trains the Trainer config `cfg` to its max_steps; returns the last step's metrics.

    Resuming a run whose checkpoint holds another model config is an error unless
    `allow_config_change`; `provenance` (the command line, ...) goes into config.json.
    Compiled programs persist in `cfg.compilation_cache_dir` while it runs."""
    cfg.klass.check_config(cfg)  # a bad setting is refused before the lease creates OUTPUT_DIR
    with compilation_cache(cfg.compilation_cache_dir):
        return _train(cfg, hooks, provenance, allow_config_change)


def _train(cfg: Any, hooks: tuple, provenance: dict | None, allow_config_change: bool) -> dict:
    import jax

    from axplug.runtime import RunDirLock, StoreLease
    from axplug.trainer.summaries import summary_dir

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
        if not allow_config_change:
            _check_same_model(trainer.checkpointer, cfg)
        write_config(cfg, provenance)
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

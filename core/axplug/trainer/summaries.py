"""Where a run's summaries go: the local summary directory, the writers built for a run, and
the goodput record appended after it."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from axplug.api.kinds import RunInfo
from axplug.checkpoint import scheme_of, storage_for
from axplug.config import InstantiableConfig
from axplug.runtime import format_goodput
from axplug.summary.base import SummaryWriter

__all__ = ["summary_dir", "build_writer", "append_goodput", "goodput_report"]

log = logging.getLogger("axplug.trainer")


def summary_dir(output_dir: str) -> str:
    """Where writers put the summaries of a run: `output_dir` itself when it is local, else a
    local mirror `~/.cache/axplug/runs/SCHEME/PATH` (JSONL and event files are appended to,
    which object stores cannot do)."""
    scheme = scheme_of(output_dir)
    if scheme == "file":
        return output_dir
    rest = output_dir.split("://", 1)[1].strip("/")
    local = os.path.join(os.path.expanduser("~/.cache/axplug/runs"), scheme, rest)
    log.info("summaries of %s are written locally to %s", output_dir, local)
    return local


def build_writer(cfg: InstantiableConfig, trainer_cfg: Any, tokens_per_step: int) -> Any:
    """A summary writer with the fields it leaves to the trainer filled in: `dir` (the run's
    summary directory), `max_steps`, `every_n_steps` (log_every), `tokens_per_step`."""
    fields = cfg.keys()  # the summary directory is made (and logged) only for a writer with one
    run = RunInfo(
        dir=summary_dir(trainer_cfg.output_dir) if "dir" in fields else "",
        max_steps=trainer_cfg.max_steps,
        every_n_steps=trainer_cfg.log_every,
        tokens_per_step=tokens_per_step or None,
    )
    return SummaryWriter.fill_run_fields(cfg, run).instantiate()


def append_goodput(trainer_cfg: Any, step: int, report: dict) -> None:
    """Appends `{"step", <report>}` to OUTPUT_DIR/goodput.jsonl (in a bucket too)."""
    storage = storage_for(trainer_cfg.output_dir, trainer_cfg.checkpointer.storage_options)
    url = storage.join(trainer_cfg.output_dir, "goodput.jsonl")
    previous = storage.read_text(url) if storage.exists(url) else ""
    storage.write_text(url, previous + json.dumps({"step": step, **report}) + "\n")


def goodput_report(trainer: Any) -> dict:
    """The run's goodput, logged and appended to OUTPUT_DIR/goodput.jsonl by process 0."""
    report = trainer.goodput.report()
    report["goodput/slow_steps"] = len(trainer.watchdog.slow_steps)
    if jax.process_index() == 0:
        # DEBUG: `axplug train` prints the report itself, and returns it in the metrics.
        log.debug("%s", format_goodput(report))
        append_goodput(trainer.config, int(jax.device_get(trainer.state["step"])), report)
    return report

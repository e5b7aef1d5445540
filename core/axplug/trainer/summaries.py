"""Where a run's summaries go: the local summary directory, the writers built for a run, and
the goodput record appended after it."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from axplug.api._kinds import RunInfo
from axplug.checkpoint import scheme_of, storage_for
from axplug.paths import CACHE, cache_path
from axplug.runtime import GoodputRecorder, format_goodput
from axplug.summary.base import SummaryWriter
from axplug.trainer.attempts import AttemptRecorder

__all__ = ["summary_dir", "build_writer", "attempt_recorder", "goodput_report"]

log = logging.getLogger("axplug.trainer")


def summary_dir(output_dir: str) -> str:
    """Where writers put the summaries of a run: `output_dir` itself when it is local, else a
    local mirror `~/.cache/axplug/runs/SCHEME/PATH` (JSONL and event files are appended to,
    which object stores cannot do)."""
    scheme = scheme_of(output_dir)
    if scheme == "file":
        return output_dir
    rest = output_dir.split("://", 1)[1].strip("/")
    local = os.path.join(cache_path(f"{CACHE}/runs"), scheme, rest)
    log.info("summaries of %s are written locally to %s", output_dir, local)
    return local


def build_writer(cfg: SummaryWriter.Config, trainer_cfg: Any, tokens_per_step: int) -> Any:
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


def attempt_recorder(cfg: Any, goodput: GoodputRecorder, start_step: int) -> AttemptRecorder | None:
    """Process 0's record of this attempt at the run of trainer config `cfg` (None on the
    other processes)."""
    if jax.process_index() != 0:
        return None
    storage = storage_for(cfg.output_dir, cfg.checkpointer.storage_options)
    url = storage.join(cfg.output_dir, "goodput.jsonl")
    started = goodput.started_at
    return AttemptRecorder(storage, url, summary_dir(cfg.output_dir), start_step, started)


def goodput_report(goodput: GoodputRecorder, slow_steps: int, attempt: AttemptRecorder | None,
                   step: int, end: str = "done") -> dict:  # fmt: skip
    """The attempt's goodput (ended at `step`) and the job's totals over every attempt; process
    0 (with the `attempt`) logs them and appends them to OUTPUT_DIR/goodput.jsonl
    (`axplug.trainer.attempts`). `end`: done, preempted."""
    report = goodput.report()
    report["goodput/slow_steps"] = slow_steps
    if attempt is not None:
        fields = attempt.finish(step, end, report)
        report.update({k: v for k, v in fields.items() if k not in ("end", "ended")})
        # DEBUG: `axplug train` prints the report itself, and returns it in the metrics.
        log.debug("%s", format_goodput(report))
    return report

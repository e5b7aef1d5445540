"""Profiling a window of train steps: `Trainer.Config.profile` (`axplug train --profile`).

`profile.steps` is `"A:B"`, steps A to B-1 as numbered in metrics.jsonl (1 to max_steps;
half-open like a Python slice: `"10:13"` traces steps 10, 11 and 12), or `"N"`, step N alone.
A `jax.profiler` trace of those steps goes to `RUN/profile/plugins/profile/<time>/`
(`<host>.xplane.pb` for TensorBoard's profile plugin / XProf, and `perfetto_trace.json.gz`
for ui.perfetto.dev); with several processes each writes its own, to
`RUN/profile/process_<i>/`. The trace starts, once the steps before are done, before the
first step's batch is read, and stops once the last step's results are ready, so it holds the
device work of the window's steps and no other's. Each step is a `StepTraceAnnotation`
("train", step_num) for XProf's step view. The first step of an attempt compiles the train
step (inside the trace when the window holds it): a window from the second step on (e.g.
`"5:8"`) shows the steady state. The profiled steps' logged step time includes the tracing's
overhead, and the trace's export counts as `other` in the goodput. Modules run in
`jax.named_scope`s of their names (axplug.module), so the trace's ops read by layer.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import jax

from axplug.config import ConfigBase, config_class
from axplug.trainer.summaries import summary_dir

__all__ = ["profile_window", "check_profile_steps", "profile_dir", "StepProfiler"]

log = logging.getLogger("axplug.trainer")

PROFILE_SUBDIR = "profile"


def profile_window(text: Any, max_steps: int) -> tuple[int, int] | str:
    """The first and last step (inclusive) of `text` ("A:B", steps A..B-1, or "N"), or why it
    is not a window of steps 1..max_steps."""
    first_text, sep, stop_text = str(text).strip().partition(":")
    try:
        first = int(first_text)
        stop = int(stop_text) if sep else first + 1
    except ValueError:
        return f"expected A:B (steps A to B-1) or N (step N), e.g. '5:8', got {text!r}"
    if first < 1 or stop < 1:
        return (
            f"steps count from 1 (the first step of the run), got {text!r}; "
            "e.g. '5:8' traces steps 5, 6 and 7"
        )
    if stop <= first:
        return f"A:B traces steps A to B-1, so B must be > A, got {text!r}"
    if stop - 1 > max_steps:
        return (
            f"{text!r} ends at step {stop - 1}, after the run's last step (max_steps "
            f"{max_steps}); steps are 1..{max_steps}"
        )
    return first, stop - 1


def check_profile_steps(cfg: Any) -> tuple[int, int] | None:
    """The window of the trainer `cfg`'s `profile.steps` (None: none); raises the ConfigError
    naming it that a run would for a bad one."""
    if cfg.profile.steps is None:
        return None
    window = profile_window(cfg.profile.steps, cfg.max_steps)
    if isinstance(window, str):
        raise cfg.profile.field_error("steps", window)
    return window


def profile_dir(output_dir: str) -> str:
    """Where this process writes its trace: `RUN/profile` (the run's local summary directory
    for a bucket), `RUN/profile/process_<i>` when there are several processes."""
    base = os.path.join(summary_dir(output_dir), PROFILE_SUBDIR)
    if jax.process_count() > 1:
        return os.path.join(base, f"process_{jax.process_index()}")
    return base


class StepProfiler:
    """Starts a `jax.profiler` trace before step `first` and stops it after step `last`'s
    results are ready, or when the run ends inside the window (`close`, from a `finally`)."""

    @config_class
    class Config(ConfigBase):
        # Steps "A:B" (A to B-1, as numbered in metrics.jsonl) or "N" traced into
        # output_dir/profile (`axplug train --profile`); None: none.
        steps: int | str | None = None

    def __init__(self, first: int, last: int, log_dir: str):
        self.first, self.last, self.log_dir = first, last, log_dir
        self.tracing = False
        self.done = False
        self._step_annotation: Any = None  # the running step's, for XProf's step view

    @classmethod
    def idle(cls) -> StepProfiler:
        """A profiler with no window: its calls do nothing."""
        return cls(1, 0, "")

    @classmethod
    def for_run(cls, cfg: Any, start: int) -> StepProfiler | None:
        """The profiler of a run resuming at `start` (steps done), or None: no
        `profile.steps`, or a window that ended before `start` (a resumed run, logged)."""
        window = check_profile_steps(cfg)
        if window is None:
            return None
        first, last = window
        if last <= start:
            log.warning(
                "profile.steps %r: steps %d..%d were done before this attempt (resumed after "
                "step %d); no trace",
                cfg.profile.steps,
                first,
                last,
                start,
            )
            return None
        if first <= start:
            log.info(
                "profile.steps: resumed after step %d, tracing steps %d..%d", start, start + 1, last
            )
            first = start + 1
        return cls(first, last, profile_dir(cfg.output_dir))

    def before_step(self, step: int, state: Any = None) -> None:
        """Called before step `step` (1-based) reads its batch; at the window's start, waits
        for `state` (the previous step's work) so the trace holds the window's steps only."""
        if not self.tracing and not self.done and self.first <= step <= self.last:
            jax.block_until_ready(state)
            self._start(step)
        if self.tracing:  # each loop iteration is one step in XProf's overview
            self._end_step_annotation()
            self._step_annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._step_annotation.__enter__()

    def _end_step_annotation(self) -> None:
        if self._step_annotation is not None:
            self._step_annotation.__exit__(None, None, None)
            self._step_annotation = None

    def _start(self, step: int) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
        except RuntimeError as e:  # e.g. the program's own trace is running
            log.warning("profile: could not start a trace: %s; no trace", e)
            self.done = True
            return
        self.tracing = True
        log.info("profiling steps %d..%d into %s", step, self.last, self.log_dir)

    def after_step(self, step: int, outputs: Any) -> None:
        """Called after step `step` is dispatched: at the window's last step, waits for
        `outputs` (so the trace holds the device work) and stops the trace."""
        if self.tracing and step >= self.last:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stops a running trace and logs where it went; a no-op otherwise."""
        if not self.tracing:
            return
        self.tracing, self.done = False, True
        self._end_step_annotation()
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001 - a failed export must not fail the run
            log.warning("profile: writing the trace to %s failed: %s", self.log_dir, e)
            return
        runs = glob.glob(os.path.join(self.log_dir, "plugins", "profile", "*"))
        where = max(runs, key=os.path.getmtime) if runs else self.log_dir
        log.info(
            "profile of steps %d..%d written to %s: view with `tensorboard --logdir %s` "
            "(pip install xprof), or open its perfetto_trace.json.gz at https://ui.perfetto.dev",
            self.first,
            self.last,
            where,
            self.log_dir,
        )

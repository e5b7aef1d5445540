"""Training progress on the terminal: a rich progress bar, or plain lines when not a TTY."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from axplug.config import config_class
from axplug.summary.base import SummaryWriter, format_scalar, to_scalars

__all__ = ["ProgressBar"]


def _format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    return str(datetime.timedelta(seconds=round(seconds)))


class ProgressBar(SummaryWriter):
    """Shows step/max_steps, loss, tokens/s and ETA.

    On a terminal this is a `rich.progress` bar redrawn at every write, with one compact line
    printed above it every `every_n_steps` steps (the loss history stays on screen);
    otherwise (logs, CI, pipes) only those lines, and the first and last step's.
    `every_n_steps=None` takes the trainer's `log_every` (10 outside a trainer).

    Tokens/s is the `tokens_per_sec` scalar when one is written, else `tokens_per_step` times
    the measured steps per second since the previous write. The trainer writes to it every
    step (`every_step`), to other writers every `log_every` steps.
    """

    every_step = True

    @config_class
    class Config(SummaryWriter.Config):
        max_steps: int | None = None
        every_n_steps: int | None = None
        tokens_per_step: int | None = None
        terminal: bool | None = None  # None: whether the stream is a TTY

    def __init__(self, cfg: Config, *, stream: TextIO | None = None):
        super().__init__(cfg)
        if cfg.every_n_steps is not None and cfg.every_n_steps < 1:
            raise cfg.field_error("every_n_steps", f"must be >= 1, got {cfg.every_n_steps}")
        self._every = cfg.every_n_steps or 10
        self._stream = stream if stream is not None else sys.stdout
        isatty = getattr(self._stream, "isatty", None)
        self.terminal = cfg.terminal if cfg.terminal is not None else bool(isatty and isatty())
        self._first: tuple[float, int] | None = None  # (time, step) of the first write
        self._last: tuple[float, int] | None = None
        self._progress = None
        self._task = None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = to_scalars(scalars)
        now, step = time.perf_counter(), int(step)
        tokens_per_sec = values.get("tokens_per_sec")
        if tokens_per_sec is None and self._config.tokens_per_step and self._last is not None:
            dt, dsteps = now - self._last[0], step - self._last[1]
            if dt > 0 and dsteps > 0:
                tokens_per_sec = dsteps * self._config.tokens_per_step / dt
        first = self._first is None
        if first:
            self._first = (now, step)
        self._last = (now, step)
        loss = values.get("loss")
        loss_text = "-" if loss is None else format_scalar(loss)
        tps_text = "-" if tokens_per_sec is None else format_scalar(tokens_per_sec)
        logged = step % self._every == 0 or step == self._config.max_steps
        line = None
        if logged or (first and not self.terminal):
            total = "" if self._config.max_steps is None else f"/{self._config.max_steps}"
            eta = _format_eta(self._eta(now, step))
            line = f"step {step}{total} loss {loss_text} tok/s {tps_text} eta {eta}"
        if self.terminal:
            self._update_bar(step, loss_text, tps_text, line)
        elif line is not None:
            print(line, file=self._stream, flush=True)

    def write_run_summary(self, step: int, scalars: Mapping[str, float]) -> None:
        """Not shown: `axplug train` prints the goodput after the bar."""

    def _eta(self, now: float, step: int) -> float | None:
        start_time, start_step = self._first
        if self._config.max_steps is None or step <= start_step or now <= start_time:
            return None
        rate = (step - start_step) / (now - start_time)
        return max(self._config.max_steps - step, 0) / rate

    def _update_bar(self, step: int, loss: str, tokens_per_sec: str, line: str | None) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tokens_per_sec]} tok/s"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(file=self._stream, force_terminal=True),
            )
            self._task = self._progress.add_task(
                "train",
                total=self._config.max_steps,
                completed=step,
                loss=loss,
                tokens_per_sec=tokens_per_sec,
            )
            self._progress.start()
        if line is not None:
            self._progress.console.print(line, highlight=False)  # above the bar, kept
        self._progress.update(self._task, completed=step, loss=loss, tokens_per_sec=tokens_per_sec)
        self._progress.refresh()  # every step, not only at the 10 Hz auto refresh

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

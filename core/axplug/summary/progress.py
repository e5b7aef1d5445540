"""Training progress on the terminal: a rich progress bar, or plain lines when not a TTY."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from axplug.config import config_class
from axplug.summary.base import SummaryWriter, format_scalar, is_eval_name, to_scalars

__all__ = ["ProgressBar", "format_progress_line"]

LINE_WIDTH = 120  # evaluator scalars beyond it are counted (`+3`), not shown


def _format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    return str(datetime.timedelta(seconds=round(seconds)))


def _short_eval_name(name: str) -> str:
    """`eval_accuracy` -> `accuracy`, `eval/hellaswag/acc` -> `hellaswag/acc`."""
    return name[len("eval_") :] if name.startswith("eval_") else name[len("eval/") :]


def format_progress_line(
    step: int,
    max_steps: int | None,
    *,
    loss: float | None,
    tokens_per_sec: float | None = None,
    eta_seconds: float | None = None,
    evals: Mapping[str, float] | None = None,
    eval_step: int | None = None,
    eval_details: bool = False,
    eval_only: bool = False,
    width: int = LINE_WIDTH,
) -> str:
    """One progress line: `step 5/20 loss 6.043 eval 5.797 tok/s 57.2k eta 0:00:02`.

    `evals` are the last evaluation's scalars (`eval_loss` and evaluator scalars named
    `eval_*` or `eval/*`), made at `eval_step`: `eval_loss` shows as `eval X` on the line of
    that step, `eval@5 X` on later ones (None: no step shown); with `eval_details` (the line of the
    step that evaluated) the other scalars follow the ETA, as many as fit in `width` characters,
    then `+N` for the rest. `eval_only` (an evaluation reported after its step's line) is
    `step 20/20 eval 4.331` and the details.
    """
    evals = evals or {}
    total = "" if max_steps is None else f"/{max_steps}"
    eval_loss = evals.get("eval_loss")
    at = "" if eval_step in (None, step) else f"@{eval_step}"
    eval_text = "" if eval_loss is None else f" eval{at} {format_scalar(eval_loss)}"
    if eval_only:
        line = f"step {step}{total}{eval_text}"
        eval_details = True
    else:
        loss_text = "-" if loss is None else format_scalar(loss)
        tps_text = "-" if tokens_per_sec is None else format_scalar(tokens_per_sec)
        eta = _format_eta(eta_seconds)
        line = f"step {step}{total} loss {loss_text}{eval_text} tok/s {tps_text} eta {eta}"
    if not eval_details:
        return line
    details = [
        f"{_short_eval_name(name)} {format_scalar(value)}"
        for name, value in evals.items()
        if name != "eval_loss"
    ]
    shown: list[str] = []
    for i, detail in enumerate(details):
        more = f" +{len(details) - i - 1}" if i + 1 < len(details) else ""
        if len(f"{line}  {' '.join([*shown, detail])}{more}") > width:
            break
        shown.append(detail)
    if len(shown) < len(details):
        shown.append(f"+{len(details) - len(shown)}")
    return f"{line}  {' '.join(shown)}" if shown else line


class ProgressBar(SummaryWriter):
    """Shows step/max_steps, loss, the last eval loss, tokens/s and ETA.

    On a terminal this is a `rich.progress` bar redrawn at every write, with one compact line
    printed above it every `every_n_steps` steps (the loss history stays on screen);
    otherwise (logs, CI, pipes) only those lines, and the first and last step's.
    `every_n_steps=None` takes the trainer's `log_every` (10 outside a trainer).

    An evaluation's write (no `loss`, scalars named `eval_*` or `eval/*`) prints a line at its
    step too: the step's line with `eval X` (its `eval_loss`) and the evaluator scalars that fit
    in 120 characters, or `step N/M eval X ...` when the step's line is already out; later lines
    keep showing the last one, with its step: `eval@N X`.

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
        self._evals: dict[str, float] = {}  # the last evaluation's scalars
        self._eval_step: int | None = None
        # The last train write: its step, loss, tokens/s and ETA, and whether a line showed it.
        self._train: tuple[int, float | None, float | None, float | None, bool] | None = None
        self._progress = None
        self._task = None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = to_scalars(scalars)
        step = int(step)
        evals = {k: v for k, v in values.items() if is_eval_name(k)}
        if evals:
            self._evals, self._eval_step = evals, step
        if evals and "loss" not in values:
            self._write_eval(step)
            return
        now = time.perf_counter()
        tokens_per_sec = values.get("tokens_per_sec")
        if tokens_per_sec is None and self._config.tokens_per_step and self._last is not None:
            dt, dsteps = now - self._last[0], step - self._last[1]
            if dt > 0 and dsteps > 0:
                tokens_per_sec = dsteps * self._config.tokens_per_step / dt
        first = self._first is None
        if first:
            self._first = (now, step)
        self._last = (now, step)
        loss, eta = values.get("loss"), self._eta(now, step)
        evaluated = self._eval_step == step
        logged = step % self._every == 0 or step == self._config.max_steps or evaluated
        line = None
        if logged or (first and not self.terminal):
            line = self._line(step, loss, tokens_per_sec, eta, details=evaluated)
        self._train = (step, loss, tokens_per_sec, eta, line is not None)
        self._show(step, loss, tokens_per_sec, line)

    def _line(self, step, loss, tokens_per_sec, eta, *, details: bool, eval_only=False) -> str:
        """The progress line of `step` with the evaluations seen so far."""
        return format_progress_line(
            step, self._config.max_steps, loss=loss, tokens_per_sec=tokens_per_sec,
            eta_seconds=eta, evals=self._evals, eval_step=self._eval_step,
            eval_details=details, eval_only=eval_only,
        )  # fmt: skip

    def _write_eval(self, step: int) -> None:
        """An evaluation's scalars: shown on its step's line, or on a line of their own when
        that step's line is already out (the trainer evaluates a step that saves a checkpoint,
        or the last, after reporting it)."""
        if self._train is None or self._train[0] != step:
            return  # the step's own write follows and shows them
        _, loss, tokens_per_sec, eta, shown = self._train
        line = self._line(step, loss, tokens_per_sec, eta, details=True, eval_only=shown)
        self._train = (step, loss, tokens_per_sec, eta, True)
        self._show(step, loss, tokens_per_sec, line)

    def _show(
        self, step: int, loss: float | None, tokens_per_sec: float | None, line: str | None
    ) -> None:
        if self.terminal:
            loss_text = "-" if loss is None else format_scalar(loss)
            tps_text = "-" if tokens_per_sec is None else format_scalar(tokens_per_sec)
            eval_loss = self._evals.get("eval_loss")
            at = "" if self._eval_step == step else f"@{self._eval_step}"
            eval_text = "" if eval_loss is None else f"eval{at} {format_scalar(eval_loss)}"
            self._update_bar(step, loss_text, eval_text, tps_text, line)
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

    def _update_bar(
        self, step: int, loss: str, eval_loss: str, tokens_per_sec: str, line: str | None
    ) -> None:
        loss = f"{loss} {eval_loss}" if eval_loss else loss  # one column: no gap without
        fields = {"loss": loss, "tokens_per_sec": tokens_per_sec}
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
                "train", total=self._config.max_steps, completed=step, **fields
            )
            self._progress.start()
        if line is not None:
            self._progress.console.print(line, highlight=False)  # above the bar, kept
        self._progress.update(self._task, completed=step, **fields)
        self._progress.refresh()  # every step, not only at the 10 Hz auto refresh

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

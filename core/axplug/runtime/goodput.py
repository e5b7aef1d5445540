"""Goodput: the wall time of a run split into what the host was doing, one phase at a time.

Phases are exclusive: entering one pauses the phase around it, so the parts always add up to
the time since the recorder started. `step` is time dispatching train steps and waiting for
their results (device compute as the host sees it); everything else is overhead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping

__all__ = ["PHASES", "GoodputRecorder", "format_goodput"]

PHASES = (
    "setup",  # building model, mesh, shardings and the checkpointer
    "init",  # initializing a fresh state
    "restore",  # restoring the state from a checkpoint (a restart)
    "compile",  # compiling (or loading from the compilation cache) the train step
    "data_wait",  # producing the next batch and copying it to the devices
    "step",  # dispatching train steps and waiting for their results
    "checkpoint",  # time the loop was blocked by checkpoint saves
    "eval",  # evaluation runs
    "other",  # logging, hooks and the rest of the loop
)


class GoodputRecorder:
    """Accumulates seconds per phase of `PHASES`; time outside any phase counts as `setup`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._start = self._mark = time.perf_counter()
        self.started_at = time.time()  # wall-clock start, for records that outlive the process
        self._stack = ["setup"]

    def _charge(self) -> None:
        now = time.perf_counter()
        self.seconds[self._stack[-1]] += now - self._mark
        self._mark = now

    def switch(self, name: str) -> None:
        """From now on, time outside any `phase` block counts as `name`."""
        self._check(name)
        self._charge()
        self._stack[0] = name

    def _check(self, name: str) -> None:
        if name not in self.seconds:
            raise ValueError(f"unknown goodput phase {name!r}; phases: {', '.join(PHASES)}")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Counts the time inside the block as `name` (minus nested phases)."""
        self._check(name)
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def total(self, phases: Iterable[str]) -> float:
        """Seconds so far in `phases`, including the running part of the current one."""
        self._charge()
        return sum(self.seconds[p] for p in phases)

    def report(self) -> dict[str, float]:
        """`goodput/<phase>_s` per phase, `goodput/wall_s`, and `goodput/fraction` (step / wall)."""
        self._charge()
        wall = self._mark - self._start  # the instant the phases were charged up to
        out = {f"goodput/{p}_s": round(s, 6) for p, s in self.seconds.items()}
        out["goodput/wall_s"] = round(wall, 6)
        out["goodput/fraction"] = round(self.seconds["step"] / wall, 6) if wall > 0 else 0.0
        return out


def format_goodput(report: Mapping[str, float]) -> str:
    """A small table of a `GoodputRecorder.report()`: seconds and share of wall time per phase."""
    wall = report["goodput/wall_s"]
    lines = [f"goodput {report['goodput/fraction']:.1%} of {wall:.2f} s wall time:"]
    for phase in PHASES:
        seconds = report.get(f"goodput/{phase}_s", 0.0)
        share = seconds / wall if wall > 0 else 0.0
        lines.append(f"  {phase:<11}{seconds:10.3f} s  {share:6.1%}")
    return "\n".join(lines)

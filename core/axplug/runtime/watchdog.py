"""A watchdog thread: reports (and optionally exits on) a hung training loop, and flags slow steps.

A step counts as completed when the trainer has read its metrics. When none completes within
`timeout_s`, the watchdog logs every thread's stack and the recent step times, calls `on_hang`,
and with `exit_on_hang` ends the process with `exit_code` (75, EX_TEMPFAIL: "try again"), so a
scheduler restarts the job, which resumes from its last checkpoint. Start-up (building the
trainer and importing plugins, restoring, the first batch, compiling) is watched the same way
with `startup_timeout_s`, and its report names the phase that stalled. Independently, a step
slower than `slow_step_factor` times the median of the last `slow_step_window` steps (a
straggling or throttled host), and longer than `slow_step_min_s`, is logged and passed to
`on_slow_step`. Sustained low utilisation is flagged once per `utilization_window` steps: the
median MFU of the window's steps below `min_mfu`, or the devices' busy percentage (read at the
window's end through a hardware plugin's `device_utilization` hook: NVML on NVIDIA GPUs, the
TPU runtime's duty cycle) below `min_device_busy_percent`; each is logged and passed to
`on_low_utilization`.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable

from axplug.config import Configurable, config_class
from axplug.runtime.exit_codes import RESTART_EXIT_CODE

__all__ = ["Watchdog", "HANG_EXIT_CODE", "thread_stacks"]

log = logging.getLogger("axplug.watchdog")

HANG_EXIT_CODE = RESTART_EXIT_CODE  # EX_TEMPFAIL: rerun to resume


def thread_stacks() -> str:
    """The current Python stack of every thread, innermost call last, one block per thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        blocks.append(f'Thread "{names.get(ident, "?")}" (ident {ident}):\n{stack}')
    return "\n".join(blocks)


class Watchdog(Configurable):
    """Watches step completions from a background thread; see the module docstring."""

    @config_class
    class Config(Configurable.Config):
        # Seconds without a completed step before the job counts as hung; None: never. Must
        # exceed the longest pause between steps (a blocking checkpoint save, an evaluation).
        timeout_s: float | None = 1800.0
        # The same for start-up, before the first step: building the trainer (plugin imports),
        # restoring, the first batch, compiling. None: start-up is not watched.
        startup_timeout_s: float | None = 3600.0
        exit_on_hang: bool = False
        exit_code: int = HANG_EXIT_CODE
        # How long on_hang hooks may run before the watchdog goes on (and exits) without them.
        hook_timeout_s: float = 30.0
        # A step slower than this many times the running median is flagged; None: never.
        slow_step_factor: float | None = 3.0
        slow_step_window: int = 100
        slow_step_min_steps: int = 10  # no flagging until this many step times are known
        # Steps shorter than this are never flagged: at millisecond steps, host jitter (an
        # asynchronous checkpoint write, say) is many times the median and means nothing.
        slow_step_min_s: float = 1.0
        # Sustained low utilisation (see the module docstring); None: not checked.
        min_mfu: float | None = None
        min_device_busy_percent: float | None = None
        utilization_window: int = 100

    def __init__(
        self,
        cfg: Config,
        *,
        on_hang: Callable[[int, float, str], None] | None = None,
        on_slow_step: Callable[[int, float, float], None] | None = None,
        on_low_utilization: Callable[[int, str, float, float], None] | None = None,
        read_device_busy: Callable[[], float | None] | None = None,
    ):
        super().__init__(cfg)
        cfg = self._config
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(cfg, name)
            if value is not None and value <= 0:
                raise cfg.field_error(name, f"must be > 0 or None, got {value}")
        if cfg.slow_step_factor is not None and cfg.slow_step_factor <= 1:
            raise cfg.field_error(
                "slow_step_factor", f"must be > 1 or None, got {cfg.slow_step_factor}"
            )
        if not 0 <= cfg.exit_code <= 255:
            raise cfg.field_error("exit_code", f"must be in [0, 255], got {cfg.exit_code}")
        if cfg.min_mfu is not None and not 0 < cfg.min_mfu <= 1:
            raise cfg.field_error("min_mfu", f"must be in (0, 1] or None, got {cfg.min_mfu}")
        busy = cfg.min_device_busy_percent
        if busy is not None and not 0 < busy <= 100:
            raise cfg.field_error(
                "min_device_busy_percent", f"must be in (0, 100] or None, got {busy}"
            )
        if cfg.utilization_window < 1:
            raise cfg.field_error(
                "utilization_window", f"must be >= 1, got {cfg.utilization_window}"
            )
        self._on_hang = on_hang
        self._on_slow_step = on_slow_step
        self._on_low_utilization = on_low_utilization
        self._read_device_busy = read_device_busy
        self._window_mfu: list[float] = []
        self._window_steps = 0
        # (step, metric, value, threshold) of every flagged window: metric "mfu" or "device_busy".
        self.low_utilization: list[tuple[int, str, float, float]] = []
        self.step_times: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=max(cfg.slow_step_window, 1)
        )
        self.slow_steps: list[int] = []
        self.hangs = 0
        self._lock = threading.Lock()
        self._last_step: int | None = None
        self._last_progress = time.monotonic()
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._phase: str | None = None  # a start-up phase, or None once steps run
        self._timeout: float | None = cfg.timeout_s

    # -- called by the training loop ---------------------------------------------------------

    def start_startup(self, phase: str) -> None:
        """Arms the hang timer with `startup_timeout_s` from now, for start-up `phase`."""
        self._arm(self._config.startup_timeout_s, phase, None)

    def phase(self, phase: str) -> None:
        """Names the start-up phase now running (in a hang report); the timer keeps running."""
        with self._lock:
            self._phase = phase

    def start(self, step: int) -> None:
        """Arms the hang timer from now (call after compilation); `step` is the last one done."""
        self._arm(self._config.timeout_s, None, step)

    def _arm(self, timeout: float | None, phase: str | None, step: int | None) -> None:
        with self._lock:
            self._last_step, self._last_progress, self._fired = step, time.monotonic(), False
            self._phase, self._timeout = phase, timeout
        if timeout is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="axplug-watchdog", daemon=True)
        self._thread.start()

    def step_completed(self, step: int, seconds: float, mfu: float | None = None) -> bool:
        """Records that `step` took `seconds` (at `mfu`, when known); returns whether it was
        flagged as slow."""
        cfg = self._config
        self._utilization(step, mfu)
        with self._lock:
            self._last_step, self._last_progress, self._fired = step, time.monotonic(), False
            known = [s for _, s in self.step_times]
            self.step_times.append((step, seconds))
        if (
            cfg.slow_step_factor is None
            or len(known) < cfg.slow_step_min_steps
            or seconds < cfg.slow_step_min_s
        ):
            return False
        median = statistics.median(known)
        if seconds <= cfg.slow_step_factor * median:
            return False
        self.slow_steps.append(step)
        log.warning(
            "step %d took %.3f s, %.1fx the median %.3f s of the last %d steps (a straggling "
            "or throttled host?)",
            step,
            seconds,
            seconds / median if median else float("inf"),
            median,
            len(known),
        )
        if self._on_slow_step is not None:
            self._on_slow_step(step, seconds, median)
        return True

    def _utilization(self, step: int, mfu: float | None) -> None:
        cfg = self._config
        if cfg.min_mfu is None and cfg.min_device_busy_percent is None:
            return
        if mfu is not None:
            self._window_mfu.append(mfu)
        self._window_steps += 1
        if self._window_steps < cfg.utilization_window:
            return
        checks = []
        if cfg.min_mfu is not None and self._window_mfu:
            checks.append(("mfu", statistics.median(self._window_mfu), cfg.min_mfu))
        if cfg.min_device_busy_percent is not None and self._read_device_busy is not None:
            busy = self._read_device_busy()
            if busy is not None:
                checks.append(("device_busy", busy, cfg.min_device_busy_percent))
        self._window_mfu, self._window_steps = [], 0
        for metric, value, threshold in checks:
            if value >= threshold:
                continue
            self.low_utilization.append((step, metric, value, threshold))
            what = "median MFU" if metric == "mfu" else "device busy percentage"
            log.warning(
                "low utilisation at step %d: %s %.3g over the last %d steps is below %.3g "
                "(watchdog.%s); an input-bound loop, a throttled device or a poor layout?",
                step,
                what,
                value,
                cfg.utilization_window,
                threshold,
                "min_mfu" if metric == "mfu" else "min_device_busy_percent",
            )
            if self._on_low_utilization is not None:
                self._on_low_utilization(step, metric, value, threshold)

    def stop(self) -> None:
        """Stops the thread; idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    # -- the thread --------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(min(max((self._timeout or 50) / 10, 0.05), 5.0)):
            with self._lock:
                idle = time.monotonic() - self._last_progress
                due = self._timeout is not None and idle > self._timeout and not self._fired
                if due:
                    self._fired = True
                    step = self._last_step
            if due:
                self._hang(step, idle)

    def report(self, step: int | None, idle: float) -> str:
        """The text logged on a hang: what stalled, recent step times, and every thread's stack."""
        with self._lock:
            recent = list(self.step_times)[-5:]
        times = ", ".join(f"step {s}: {t:.3f} s" for s, t in recent) or "none completed yet"
        median = statistics.median(t for _, t in self.step_times) if self.step_times else None
        if self._phase is not None:
            stalled = (
                f"start-up stalled for {idle:.1f} s in {self._phase} (watchdog.startup_timeout_s"
                f" = {self._config.startup_timeout_s})"
            )
        else:
            stalled = (
                f"no training step completed for {idle:.1f} s (watchdog.timeout_s = "
                f"{self._config.timeout_s})"
            )
        return (
            f"{stalled}; last completed step: {step}\n"
            f"last step times: {times}"
            + (f"; median {median:.3f} s\n" if median is not None else "\n")
            + f"stacks of all threads (pid {os.getpid()}):\n{thread_stacks()}"
        )

    def _hang(self, step: int | None, idle: float) -> None:
        self.hangs += 1
        report = self.report(step, idle)
        log.error("HANG: %s", report)
        if self._on_hang is not None:
            hook = threading.Thread(
                target=self._on_hang, args=(step, idle, report), name="axplug-on-hang", daemon=True
            )
            hook.start()
            hook.join(self._config.hook_timeout_s)
            if hook.is_alive():
                log.error(
                    "on_hang hooks still running after %.0f s (watchdog.hook_timeout_s); going on",
                    self._config.hook_timeout_s,
                )
        if self._config.exit_on_hang:
            log.error(
                "exiting with code %d (watchdog.exit_on_hang) so the scheduler restarts the job",
                self._config.exit_code,
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(self._config.exit_code)

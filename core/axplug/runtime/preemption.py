"""Graceful preemption: SIGTERM and SIGINT ask the training loop to stop after the step in
flight; every process agrees on that step, saves it and exits `RESTART_EXIT_CODE`.

The first signal only sets a flag. Processes agree on the stop step through a collective run
after every train step: the maximum over processes of their flags, read one step later (as the
step's metrics are), so every process reads the same value at the same step and stops there,
whatever step each host's signal arrived at. A second signal ends the process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from axplug.runtime.exit_codes import RESTART_EXIT_CODE

__all__ = ["Preempted", "StopSignals", "StopAgreement"]


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at `step` on a signal, with that step saved; rerun to resume."""

    exit_code = RESTART_EXIT_CODE

    def __init__(self, step: int, signal_name: str, saved: bool = True):
        self.step, self.signal_name, self.saved = step, signal_name, saved
        what = "saved" if saved else "before any new step, nothing to save"
        super().__init__(f"preempted at step {step} ({signal_name}): {what}; rerun to resume")


class StopSignals:
    """While entered, SIGTERM and SIGINT set `requested` (the signal's name) instead of ending
    the process; a second one (0.25 s or more later) ends it at once with 128 + the signal
    number. Outside the main thread (signals cannot be caught there) it does nothing."""

    def __init__(self) -> None:
        self._requested: str | None = None
        self._outer: StopSignals | None = None  # an enclosing StopSignals already catching
        self._previous: dict[int, Any] = {}
        self._at = 0.0  # when the first signal came

    @property
    def requested(self) -> str | None:
        """The name of the first signal received, or None."""
        return self._outer.requested if self._outer is not None else self._requested

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        # Within 0.25 s of the first it is the same event: a multi-threaded parent that dies
        # sends its death signal (PR_SET_PDEATHSIG) once per thread that exits.
        if self._requested is not None and time.monotonic() - self._at < 0.25:
            return
        if self._requested is not None:
            # A second signal: the operator (or the scheduler's kill) will not wait.
            sys.stderr.write(f"\n{name} again: exiting now, without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self._requested, self._at = name, time.monotonic()
        sys.stderr.write(
            f"\n{name}: finishing the step in flight, then saving; send it again to exit now\n"
        )
        sys.stderr.flush()

    def __enter__(self) -> StopSignals:
        outer = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if isinstance(outer, StopSignals):  # a command caught them from its start: share
            self._outer = outer
        elif threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._outer = None


class StopAgreement:
    """The stop decision every process reads at the same step.

    `update(requested)` is called once per train step on every process, in the same order as
    the steps; it returns True when the processes must stop after the current step. One
    process: the flag itself. Several: the flag of the step before, reduced over processes by
    a small collective dispatched with the steps (so it costs no extra host round trip)."""

    def __init__(self, mesh: Any):
        import jax

        self._multi = jax.process_count() > 1
        self._pending: Any = None
        if not self._multi:
            return
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        devices = np.asarray(mesh.devices).reshape(-1)
        self._mesh = jax.sharding.Mesh(devices, ("all",))
        self._flags = NamedSharding(self._mesh, PartitionSpec("all"))
        self._local = [d for d in devices if d.process_index == jax.process_index()]
        self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(self._mesh, PartitionSpec()))

    def update(self, requested: bool) -> bool:
        if not self._multi:
            return requested
        import jax
        import numpy as np

        flag = np.asarray([1 if requested else 0], np.int32)
        shards = [jax.device_put(flag, d) for d in self._local]
        flags = jax.make_array_from_single_device_arrays(
            (self._mesh.devices.size,), self._flags, shards
        )
        previous, self._pending = self._pending, self._reduce(flags)
        return previous is not None and bool(jax.device_get(previous))

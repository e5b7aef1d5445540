"""`axplug launch --agent -- axplug train ...`: restart the trainer in place, in its pod or node.

A pod (or a Slurm task) runs the agent around `axplug train`. When the trainer exits with
`RESTART_EXIT_CODE` (75: preempted and saved, hung, or a lost peer) or dies from a signal,
the agent starts it again in the same pod, without the scheduler recreating anything, up to
`--max-restarts` times; each restart is logged with its reason and, once the new trainer
completes a step, the recovery time. Exit 0 ends the agent with 0; any other code (1: a failed
run, 2: bad flags or config) ends it with that code. A SIGTERM or SIGINT to the agent goes to
the trainer (which saves and exits 75) and the agent then exits with the trainer's code
instead of restarting: the pod is going away.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from axplug_launch._child import Child, describe_exit

__all__ = ["RESTART_EXIT_CODE", "DEFAULT_MAX_RESTARTS", "run_agent", "needs_restart"]

RESTART_EXIT_CODE = 75  # axplug.runtime.RESTART_EXIT_CODE, repeated so the agent imports no jax
DEFAULT_MAX_RESTARTS = 5
_POLL_S = 0.05


def needs_restart(code: int) -> bool:
    """Whether a trainer's exit asks for a rerun: 75, or death from a signal."""
    return code == RESTART_EXIT_CODE or code < 0


def _shell_code(code: int) -> int:
    """A Popen return code as a process exit status (a signal N as 128 + N)."""
    return 128 - code if code < 0 else code


def run_agent(
    command: Sequence[str],
    *,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    log_path: str | None = None,
) -> int:
    """Runs `command` until it exits 0, a code that is not a restart, or the budget runs out;
    the trainer's output goes to `log_path` (default: a file under the temp directory), which
    the agent follows."""
    out = out or sys.stdout
    log_path = log_path or os.path.join(
        tempfile.gettempdir(), f"axplug-agent-{os.getpid()}", "trainer.log"
    )
    stopping: list[int] = []
    child: Child | None = None

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if child is not None:
            child.send(signal.SIGTERM if len(stopping) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        restarts, exited_at = 0, None
        while True:
            child = Child(command, env=env or os.environ, out=out, log_path=log_path)
            reported = exited_at is None
            while (code := child.poll()) is None:
                reported = reported or _report(out, child, restarts, exited_at)
                time.sleep(_POLL_S)
            code = child.wait(None)
            if not reported:
                _report(out, child, restarts, exited_at)
            exited_at = time.time()
            if code == 0:
                return 0
            if stopping:
                _say(out, f"agent: trainer stopped ({describe_exit(code)}) after a signal")
                return _shell_code(code)
            if not needs_restart(code):
                return code
            if restarts >= max_restarts:
                _say(
                    out,
                    f"error: agent: the trainer asked for restart {restarts + 1} "
                    f"({describe_exit(code)}) but --max-restarts is {max_restarts}; giving up "
                    "(exit 1) so the scheduler sees a failed run",
                )
                return 1
            restarts += 1
            reason = "its state is safe" if code == RESTART_EXIT_CODE else "it died"
            _say(
                out,
                f"agent: trainer ended ({describe_exit(code)}: {reason}); restart {restarts} of "
                f"{max_restarts} in place",
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report(out: TextIO, child: Child, restarts: int, exited_at: float | None) -> bool:
    """Logs a restarted trainer's first step and the time since the last exit, once seen."""
    if child.first_step_at is None or exited_at is None:
        return False
    _say(
        out,
        f"agent: restart {restarts} recovered: step {child.first_step} done "
        f"{child.first_step_at - exited_at:.2f} s after the exit",
    )
    return True


def _say(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()

"""`axplug launch --local`: N trainer processes and S standby hosts on this machine.

The supervisor starts `axplug train` as processes 0..N-1 of one job on 127.0.0.1, each with
its own fake CPU devices (`--devices-per-host`). When a trainer dies (killed, or its "host"
lost) it notes the time, kills the other trainers (a collective with a dead peer cannot
save; they would exit 75 within the peer timeout anyway), retires the failed host, swaps a
standby host in under the same process id, and restarts all N from the newest checkpoint on
a fresh coordinator port. A trainer exiting 75 on its own (preempted and saved, hung) is
restarted in place. Standby hosts may run a low-priority job (`--spare-command`), sent
SIGTERM when its host is taken. With `--elastic` and no standby left the job continues on
fewer processes, the global batch kept by gradient accumulation, and grows back when a
retired host is healthy again (`--regrow-after`). One line per swap, and the recovery time:
from the failure to the next completed step.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TextIO

from axplug_launch._child import Child, describe_exit
from axplug_launch._hosts import Host, HostPool, elastic_processes
from axplug_launch.agent import RESTART_EXIT_CODE, needs_restart

__all__ = ["LocalJob", "run_local", "trainer_env"]

_POLL_S = 0.05
_ACCUMULATION = "learner.grad_accumulation_steps"
_PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id")


@dataclasses.dataclass(frozen=True)
class LocalJob:
    """What `launch --local` runs."""

    command: tuple[str, ...]  # `axplug train ...`, without the process flags
    processes: int
    spares: int = 0
    devices_per_host: int = 1
    scratch_dir: str = ".axplug-hosts"
    spare_command: tuple[str, ...] = ()
    elastic: bool = False
    regrow_after_s: float | None = None
    max_restarts: int = 10
    grace_s: float = 120.0  # a SIGTERMed trainer's time to save (grow, stop)
    spare_grace_s: float = 30.0  # a low-priority job's time to yield its host


def trainer_env(host: Host, devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on `host`: its fake device count and its identity."""
    env = dict(os.environ if base is None else base)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["AXPLUG_HOST"], env["AXPLUG_HOST_DIR"] = host.name, host.directory
    return env


def _for_host(words: tuple[str, ...], host: Host) -> list[str]:
    return [w.replace("{host_dir}", host.directory).replace("{host}", host.name) for w in words]


def _base_accumulation(command: tuple[str, ...]) -> int:
    """The trainer command's own `--set learner.grad_accumulation_steps=K` (the last), or 1."""
    value = 1
    for flag, arg in zip(command, command[1:], strict=False):
        if flag == "--set" and arg.startswith(_ACCUMULATION + "="):
            value = int(arg.split("=", 1)[1])
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Supervisor:
    def __init__(self, job: LocalJob, out: TextIO):
        self.job, self.out = job, out
        self.lock = threading.Lock()
        self.pool = HostPool(job.processes, job.spares, job.scratch_dir, job.regrow_after_s)
        self.base_accumulation = _base_accumulation(job.command)
        self.lowprio: dict[str, Child] = {}
        self.trainers: list[Child] = []
        self.signals: list[int] = []
        self.restarts = 0
        self.attempt = 0

    def say(self, line: str) -> None:
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()

    # --- standby hosts -------------------------------------------------------------------

    def start_lowprio(self, host: Host) -> None:
        if not self.job.spare_command:
            return
        env = trainer_env(host, self.job.devices_per_host)
        child = Child(
            _for_host(self.job.spare_command, host),
            env=env,
            out=self.out,
            prefix=f"[{host.name} standby] ",
            lock=self.lock,
            log_path=os.path.join(host.directory, "standby.log"),
        )
        self.lowprio[host.name], host.pid = child, child.pid

    def take(self, host: Host) -> str:
        """Stops `host`'s low-priority job, if any; how it ended, for the swap line."""
        child = self.lowprio.pop(host.name, None)
        if child is None:
            return ""
        code = child.stop(self.job.spare_grace_s)
        return f" (its low-priority job stopped: {describe_exit(code)})"

    # --- one attempt ---------------------------------------------------------------------

    def accumulation(self) -> int:
        return self.base_accumulation * self.job.processes // len(self.pool.training)

    def start_trainers(self) -> None:
        self.attempt += 1
        n, port = len(self.pool.training), _free_port()
        accumulation = self.accumulation()
        self.trainers = []
        for i, host in enumerate(self.pool.training):
            argv = _for_host(self.job.command, host)
            if n > 1:
                argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n)]
                argv += ["--process-id", str(i)]
            if accumulation != self.base_accumulation:
                argv += ["--set", f"{_ACCUMULATION}={accumulation}"]
            child = Child(
                argv,
                env=trainer_env(host, self.job.devices_per_host),
                out=self.out,
                prefix=f"[{host.name}] ",
                lock=self.lock,
                log_path=os.path.join(host.directory, f"trainer-attempt{self.attempt}.log"),
            )
            self.trainers.append(child)
            host.pid = child.pid
        self.pool.save_host_states(attempt=self.attempt, coordinator=f"127.0.0.1:{port}")
        names = ", ".join(h.name for h in self.pool.training)
        extra = f", {_ACCUMULATION}={accumulation}" if n != self.job.processes else ""
        self.say(f"launch: attempt {self.attempt}: {n} processes on {names}{extra}")

    def stop_trainers(self, graceful: bool) -> list[int]:
        if graceful:
            for child in self.trainers:
                child.send(signal.SIGTERM)
            deadline = time.time() + self.job.grace_s
            codes = []
            for child in self.trainers:
                try:
                    codes.append(child.wait(max(deadline - time.time(), 0.01)))
                except subprocess.TimeoutExpired:
                    codes.append(child.kill())
            return codes
        return [child.kill() for child in self.trainers]

    def watch(self, since: tuple[float, str] | None) -> tuple[str, int, int]:
        """Until the attempt ends: ("done", 0, -1), ("failed", code, process id), ("grow", 0,
        -1) or ("signal", signum, -1)."""
        reported = since is None
        while True:
            if self.signals:
                return "signal", self.signals[0], -1
            head = self.trainers[0]
            if not reported and head.first_step_at is not None and since is not None:
                failed_at, what = since
                resumed = f", resumed from step {head.resumed_from}" if head.resumed_from else ""
                self.say(
                    f"launch: recovered: step {head.first_step} done "
                    f"{head.first_step_at - failed_at:.2f} s after {what}{resumed}"
                )
                reported = True
            codes = [child.poll() for child in self.trainers]
            if all(code == 0 for code in codes):
                return "done", 0, -1
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The host that died first is the cause; the others exit 75 because of it.
                i, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
                return "failed", code, i
            for host in self.pool.return_healed():
                self.say(f"launch: {host.name} is healthy again and stands by")
                self.start_lowprio(host)
            if self.job.elastic and reported and self.can_grow():
                return "grow", 0, -1
            time.sleep(_POLL_S)

    def can_grow(self) -> bool:
        n = len(self.pool.training)
        available = n + len(self.pool.standby())
        return n < self.job.processes and elastic_processes(self.job.processes, available) > n

    # --- the job -------------------------------------------------------------------------

    def run(self) -> int:
        for host in self.pool.standby():
            self.start_lowprio(host)
        since: tuple[float, str] | None = None
        try:
            while True:
                self.start_trainers()
                outcome, code, index = self.watch(since)
                now = time.time()
                if outcome == "done":
                    self.say(f"launch: done after {self.attempt} attempt(s)")
                    return 0
                if outcome == "signal":
                    codes = self.stop_trainers(graceful=True)
                    self.say(f"launch: stopped by {signal.Signals(code).name}")
                    return 0 if all(c == 0 for c in codes) else RESTART_EXIT_CODE
                if outcome == "grow":
                    since = (now, "the stop to grow")
                    self.grow()
                    continue
                host = self.pool.training[index]
                self.stop_trainers(graceful=False)
                if not needs_restart(code):
                    self.say(
                        f"launch: {host.name} (process {index}) ended with "
                        f"{describe_exit(code)}: not a restart (only 75 and signals are); "
                        "stopping the job"
                    )
                    return code
                self.restarts += 1
                if self.restarts > self.job.max_restarts:
                    self.say(
                        f"error: launch --local: the job needed {self.restarts} restarts, more "
                        f"than --max-restarts {self.job.max_restarts}; last: {host.name} "
                        f"(process {index}) {describe_exit(code)}"
                    )
                    return 1
                since = (now, f"{host.name} failed")
                if code == RESTART_EXIT_CODE:
                    self.say(
                        f"launch: {host.name} (process {index}) exited 75 (state saved): "
                        f"restarting all {len(self.pool.training)} processes in place"
                    )
                elif not self.replace(host, index, code):
                    return RESTART_EXIT_CODE
        finally:
            for child in [*self.trainers, *self.lowprio.values()]:
                child.kill()

    def replace(self, host: Host, index: int, code: int) -> bool:
        """Swaps a standby host in for `host`, or shrinks with --elastic; False: neither."""
        lost = f"launch: {host.name} (process {index}) lost ({describe_exit(code)})"
        spare = self.pool.swap(host)
        if spare is not None:
            stopped = self.take(spare)
            left = len(self.pool.standby())
            self.say(
                f"{lost}: swapped in {spare.name}{stopped} as process {index}; {left} standby "
                f"left; restarting {len(self.pool.training)} processes from the newest checkpoint"
            )
            return True
        if not self.job.elastic:
            self.say(
                f"error: {lost.removeprefix('launch: ')} and no standby host is left; the "
                "state is safe: rerun with more --spares, or --elastic to continue on fewer "
                "processes"
            )
            return False
        n = elastic_processes(self.job.processes, len(self.pool.training))
        for extra in self.pool.training[n:]:
            extra.state = "standby"
            self.start_lowprio(extra)
        del self.pool.training[n:]
        self.say(
            f"{lost}, no standby left: --elastic continues on {n} of {self.job.processes} "
            f"processes, {_ACCUMULATION}={self.accumulation()} (global batch kept)"
        )
        return True

    def grow(self) -> None:
        n = len(self.pool.training)
        available = n + len(self.pool.standby())
        target = elastic_processes(self.job.processes, available)
        self.stop_trainers(graceful=True)
        joined = self.pool.grow(target - n)
        for host in joined:
            self.take(host)
        self.say(
            f"launch: growing from {n} to {target} processes "
            f"({', '.join(h.name for h in joined)} joined), {_ACCUMULATION}={self.accumulation()}"
        )


def run_local(job: LocalJob, out: TextIO | None = None) -> int:
    """Runs `job` to the end; the exit code of the job (0, 1, 2, or 75: rerun to resume)."""
    supervisor = _Supervisor(job, out or sys.stdout)
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda n, _f: supervisor.signals.append(n)) for s in handled}
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

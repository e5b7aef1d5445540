"""The hosts of `launch --local`: named slots that train, stand by, or are retired.

Hosts are host-0..host-(N+S-1), each with its own scratch directory (its "local disk", e.g.
for `checkpointer.local.directory`). The first N train, as processes 0..N-1; the rest stand
by. A failed host is retired and a standby host takes its process id; with `regrow_after_s`
a retired host is healthy again that many seconds later and stands by once more.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from axplug.api.checkpoint import write_text

__all__ = ["Host", "HostPool", "elastic_processes"]


@dataclasses.dataclass
class Host:
    """One slot: its identity, its scratch dir and what it is doing."""

    name: str
    directory: str
    state: str = "standby"  # "training", "standby" or "retired"
    retired_at: float | None = None
    pid: int | None = None  # its trainer's (or its low-priority job's) process id


class HostPool:
    """N training hosts and S standby ones; swaps, retirements and returns."""

    def __init__(self, processes: int, spares: int, scratch_dir: str, regrow_after_s=None):
        self.target = processes
        self.regrow_after_s = regrow_after_s
        self.hosts = [
            Host(f"host-{i}", os.path.join(scratch_dir, f"host-{i}"))
            for i in range(processes + spares)
        ]
        for host in self.hosts:
            os.makedirs(host.directory, exist_ok=True)
        self.training = self.hosts[:processes]  # in process-id order
        for host in self.training:
            host.state = "training"
        self._state_file = os.path.join(scratch_dir, "hosts.json")

    def standby(self) -> list[Host]:
        return [h for h in self.hosts if h.state == "standby"]

    def retire(self, host: Host) -> None:
        host.state, host.retired_at, host.pid = "retired", time.time(), None

    def swap(self, failed: Host) -> Host | None:
        """Retires `failed`; the first standby host takes its process id (None: none left)."""
        index = self.training.index(failed)
        self.retire(failed)
        spares = self.standby()
        if not spares:
            del self.training[index]
            return None
        self.training[index] = spares[0]
        spares[0].state = "training"
        return spares[0]

    def return_healed(self, now: float | None = None) -> list[Host]:
        """Retired hosts whose `regrow_after_s` has passed, back on standby."""
        if self.regrow_after_s is None:
            return []
        now = time.time() if now is None else now
        healed = [
            h
            for h in self.hosts
            if h.state == "retired" and now - (h.retired_at or now) >= self.regrow_after_s
        ]
        for host in healed:
            host.state, host.retired_at = "standby", None
        return healed

    def grow(self, count: int) -> list[Host]:
        """Up to `count` standby hosts join the training ones, at the end."""
        joined = self.standby()[:count]
        for host in joined:
            host.state = "training"
        self.training += joined
        return joined

    def save_host_states(self, **extra: object) -> None:
        """OUTPUT: SCRATCH/hosts.json, every host's state and pid, and `extra`."""
        record = {
            "hosts": [
                {
                    "name": h.name,
                    "state": h.state,
                    "process_id": self.training.index(h) if h in self.training else None,
                    "pid": h.pid,
                    "directory": h.directory,
                }
                for h in self.hosts
            ],
            **extra,
        }
        write_text(self._state_file, json.dumps(record, indent=1))


def elastic_processes(target: int, available: int) -> int:
    """The most processes, at most `available`, that divide `target`: each then runs
    `target // n` times the microbatches so the global batch and per-device rows stay."""
    for n in range(min(target, available), 0, -1):
        if target % n == 0:
            return n
    return 0

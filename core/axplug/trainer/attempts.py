"""Goodput across restarts: each attempt at a run appends one record to OUTPUT_DIR/goodput.jsonl,
and the job's totals over every attempt so far ride on the newest record.

An attempt that dies without writing its record (SIGKILL, a lost machine) is recovered from
`progress.json`, which process 0 rewrites at most once a second while it trains (in the local
summary directory, beside metrics.jsonl): the next attempt appends the dead one's record
(`"end": "killed"`, its steps and wall time to its last sign of life) before its own.
Steps an attempt computed past the checkpoint the next attempt resumed from count as lost;
the time from an attempt's last sign of life to the next one's start as restart time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from axplug.files import write_text

__all__ = ["AttemptRecorder", "job_totals"]

_PROGRESS_EVERY_S = 1.0


def job_totals(records: list[dict]) -> dict[str, float]:
    """`job/*` totals over the attempt records of goodput.jsonl, oldest first."""
    computed = sum(r.get("steps", 0) for r in records)
    lost = sum(r.get("lost_steps", 0) for r in records)
    wall = sum(r.get("goodput/wall_s", 0.0) for r in records)
    restart = sum(r.get("restart_s", 0.0) for r in records)
    step_s = sum(r.get("goodput/step_s", 0.0) for r in records)
    productive = computed - lost
    # Step time spent on steps that were later lost is not productive.
    useful = step_s * productive / computed if computed else 0.0
    total = wall + restart
    return {
        "job/attempts": len(records),
        "job/steps_computed": computed,
        "job/productive_steps": productive,
        "job/lost_steps": lost,
        "job/restarts": len(records) - 1,
        "job/restart_s": round(restart, 6),
        "job/recovery_s": round(sum(r.get("recovery_s", 0.0) for r in records[1:]), 6),
        "job/wall_s": round(total, 6),
        "job/goodput_fraction": round(useful / total, 6) if total > 0 else 0.0,
    }


class AttemptRecorder:
    """Process 0's record of one attempt: started at `start_step`, read from and written to
    the run's goodput.jsonl (through `storage`) and `summary_dir`/progress.json."""

    def __init__(
        self, storage: Any, goodput_url: str, summary_dir: str, start_step: int, started: float
    ):
        self._storage, self._url = storage, goodput_url
        self._progress = os.path.join(summary_dir, "progress.json")
        self.start_step = start_step
        self.started = started  # wall-clock time the attempt's process began
        self._first_step_at: float | None = None
        self._written = 0.0
        self.records = self._read_records()
        previous = self._recover_killed()
        self.attempt = (self.records[-1]["attempt"] if self.records else 0) + 1
        self.lost_steps = max(0, previous[0] - start_step) if previous else 0
        self.restart_s = max(0.0, self.started - previous[1]) if previous else 0.0

    def _read_records(self) -> list[dict]:
        if not self._storage.exists(self._url):
            return []
        records = []
        for line in self._storage.read_text(self._url).splitlines():
            if line.strip():
                records.append(json.loads(line))
        for i, record in enumerate(records):  # records from before attempts were numbered
            record.setdefault("attempt", i + 1)
        return records

    def _recover_killed(self) -> tuple[int, float] | None:
        """(step reached, when) of the previous attempt; appends its record if it left none."""
        progress = None
        if os.path.exists(self._progress):
            with open(self._progress) as f:
                progress = json.load(f)
        last = self.records[-1] if self.records else None
        if progress is not None and (last is None or progress["attempt"] > last["attempt"]):
            # progress.json lags by up to a second; the checkpoint this attempt resumes from
            # proves the dead one reached at least its step.
            reached = max(progress["step"], self.start_step)
            record = {
                "step": reached,
                "attempt": progress["attempt"],
                "end": "killed",
                "start_step": progress["start_step"],
                "steps": reached - progress["start_step"],
                "lost_steps": progress.get("lost_steps", 0),
                "restart_s": progress.get("restart_s", 0.0),
                "goodput/wall_s": round(progress["time"] - progress["started"], 6),
                "goodput/step_s": progress.get("step_s", 0.0),
                "ended": progress["time"],
            }
            self._append(record)
            os.remove(self._progress)
            return reached, progress["time"]
        if last is None:
            return None
        return last["step"], last.get("ended", self.started)

    def _append(self, record: dict) -> None:
        self.records.append(record)
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        self._storage.write_text(self._url, text)

    def step_completed(self, step: int, step_s: float) -> None:
        """Notes the newest completed step; rewrites progress.json at most once a second."""
        now = time.time()
        if self._first_step_at is None:
            self._first_step_at = now
        if now - self._written < _PROGRESS_EVERY_S:
            return
        self._written = now
        progress = {
            "attempt": self.attempt,
            "start_step": self.start_step,
            "step": step,
            "started": self.started,
            "time": now,
            "lost_steps": self.lost_steps,
            "restart_s": self.restart_s,
            "step_s": round(step_s, 6),
        }
        write_text(self._progress, json.dumps(progress))

    def finish(self, step: int, end: str, report: dict) -> dict:
        """Appends this attempt's record (`report` plus the attempt's fields and the job's
        totals) and returns the fields added to the report."""
        now = time.time()
        fields = {
            "attempt": self.attempt,
            "end": end,
            "start_step": self.start_step,
            "steps": step - self.start_step,
            "lost_steps": self.lost_steps,
            "restart_s": round(self.restart_s, 6),
            "recovery_s": round((self._first_step_at or now) - self.started, 6),
            "ended": now,
        }
        record = {"step": step, **report, **fields}
        fields.update(job_totals([*self.records, record]))
        self._append({**record, **{k: v for k, v in fields.items() if k.startswith("job/")}})
        if os.path.exists(self._progress):
            os.remove(self._progress)  # the record now says everything progress.json did
        return fields

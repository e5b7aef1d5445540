"""Metrics as JSON lines: `DIR/metrics.jsonl`, one object per logged step."""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
from collections.abc import Mapping

from axplug.config import REQUIRED, Required, config_class
from axplug.files import write_text
from axplug.summary.base import SummaryWriter, to_scalars

__all__ = ["JsonlWriter", "read_jsonl"]


# Files written before NaN was written as NaN held the strings "nan", "inf", "-inf".
_OLD_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file, in order (a file that does not exist has none)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    # A last line without its newline is still being written (or was cut by a kill): not a record.
    complete, _, _ = path.read_text().rpartition("\n")
    records = [json.loads(line) for line in complete.splitlines() if line.strip()]
    for record in records:
        for key, value in record.items():
            if isinstance(value, str) and value in _OLD_NONFINITE:
                record[key] = _OLD_NONFINITE[value]
    return records


class JsonlWriter(SummaryWriter):
    """Appends `{"step": .., "time": .., <scalars>}` lines to `dir/filename`.

    Names stay flat (`loss`, `eval_loss`, `goodput/wall_s`): columns for pandas and jq; the
    dashboard writers group them (`group_tag`).

    Each line is written with one call and flushed, so a killed process leaves only whole
    lines; a partial last line (from a crash mid-write) is removed when the file is reopened,
    and a resumed run appends to the same file. `truncate(step)` drops records at or after a
    step, for a run resumed from an earlier checkpoint.
    """

    @config_class
    class Config(SummaryWriter.Config):
        dir: Required[str] = REQUIRED
        filename: str = "metrics.jsonl"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.path = pathlib.Path(cfg.dir) / cfg.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_partial_line()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _drop_partial_line(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = to_scalars(scalars)
        clash = {"step", "time"} & values.keys()
        if clash:
            raise ValueError(f"summary names {sorted(clash)} are reserved by {type(self).__name__}")
        record = {"step": int(step), "time": round(time.time(), 3)}
        # NaN and infinities as `NaN` / `Infinity`: what Python's json, pandas and
        # JavaScript's JSON5 read back as numbers.
        record.update(values)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def write_run_summary(self, step: int, scalars: Mapping[str, float]) -> None:
        """Not written: one record per step here; OUTPUT_DIR/goodput.jsonl holds each run's."""

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def truncate(self, step: int) -> None:
        """Removes the records with `step >= step` (atomically: the file is replaced)."""
        self._file.flush()
        kept = [r for r in read_jsonl(self.path) if r["step"] < step]
        self._file.close()
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

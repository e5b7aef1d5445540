"""What a summary-writer plugin's tests compare against: the run's own metrics.jsonl."""

from __future__ import annotations

import math
import os

import pytest

from axplug.summary import group_tag, read_jsonl

__all__ = ["metrics_as_tags", "scalars_match", "expected_writer_scalars"]


def metrics_as_tags(path: str | os.PathLike[str]) -> dict[tuple[int, str], float]:
    """metrics.jsonl as {(step, dashboard tag): value}."""
    return {
        (r["step"], group_tag(k)): v
        for r in read_jsonl(path)
        for k, v in r.items()
        if k not in ("step", "time")
    }


def scalars_match(a: dict, b: dict) -> bool:
    """Same keys, values equal to 1e-6 (NaN equals NaN)."""
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-6) for k in a
    )


def expected_writer_scalars(run_dir, final: dict) -> dict[tuple[int, str], float]:
    """What a writer of a 4-step run into `run_dir` must have received: metrics.jsonl's
    scalars, and the run's goodput at its last step (goodput.jsonl's record, not a
    metrics.jsonl line); `final` is what the run returned."""
    want = metrics_as_tags(os.path.join(run_dir, "metrics.jsonl"))
    assert {step for step, _ in want} == {1, 2, 3, 4} and (4, "train/loss") in want
    (goodput,) = read_jsonl(os.path.join(run_dir, "goodput.jsonl"))
    # The attempt's fields and the job's totals go to writers too (`end` is a word: not).
    want |= {(4, group_tag(k)): v for k, v in goodput.items() if k not in ("step", "end", "ended")}
    assert want[(4, "goodput/wall_s")] == pytest.approx(final["goodput/wall_s"])
    return want

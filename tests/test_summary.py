"""Summary writers: JSON lines, terminal progress, fan-out (dashboards are plugins')."""

import io
import json
import math

import numpy as np
import pytest

from axplug.summary import (
    CompositeWriter,
    JsonlWriter,
    ProgressBar,
    SummaryWriter,
    group_tag,
    read_jsonl,
)


def jsonl(tmp_path):
    return JsonlWriter.default_config().set(dir=str(tmp_path)).instantiate()


def test_jsonl_writes_one_flushed_object_per_step_in_order(tmp_path):
    writer = jsonl(tmp_path)
    for step in (1, 2, 3):
        writer.write(step, {"loss": 4.0 / step, "lr": np.float32(0.5)})
        # flushed per line: readable before close, as after a kill
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(
            range(1, step + 1)
        )
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"]) for r in records] == [
        (1, 4.0, 0.5),
        (2, 2.0, 0.5),
        (3, 4.0 / 3, 0.5),
    ]
    assert all(isinstance(r["time"], float) for r in records)


def test_jsonl_appends_on_resume_and_drops_a_partial_line(tmp_path):
    with jsonl(tmp_path) as writer:
        writer.write(1, {"loss": 1.0})
        writer.write(2, {"loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a write cut short by a crash
    with jsonl(tmp_path) as writer:
        writer.write(3, {"loss": 3.0, "bad": float("nan"), "big": float("-inf")})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert math.isnan(records[-1]["bad"]) and records[-1]["big"] == -math.inf
    last_line = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"bad": NaN' in last_line and '"big": -Infinity' in last_line  # numbers, not strings


def test_read_jsonl_skips_a_last_line_still_being_written(tmp_path):
    """A reader polling a live file sees whole records only, never a half-written line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_jsonl_reads_the_nonfinite_strings_older_files_hold(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": "nan", "x": "inf", "n": "n"}\n')
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert math.isnan(record["loss"]) and record["x"] == math.inf and record["n"] == "n"


def test_jsonl_truncate_drops_steps_from_a_resumed_checkpoint_on(tmp_path):
    with jsonl(tmp_path) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
        writer.truncate(3)
        writer.write(3, {"loss": 30.0})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_jsonl_rejects_reserved_names_and_non_scalars(tmp_path):
    with jsonl(tmp_path) as writer:
        with pytest.raises(ValueError, match=r"\['step'\] are reserved"):
            writer.write(1, {"step": 1.0})
        with pytest.raises(TypeError, match=r"summary 'v': expected a scalar, got ndarray"):
            writer.write(1, {"v": np.zeros(3)})


def test_progress_prints_compact_lines_when_not_a_tty(capsys):
    cfg = ProgressBar.default_config().set(max_steps=25, every_n_steps=10, tokens_per_step=512)
    with cfg.instantiate() as bar:
        assert not bar.terminal
        for step in range(1, 26):
            bar.write(step, {"loss": 3.0 + 1 / step})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert lines[0].startswith("step 1/25 loss 4 tok/s - eta")
    assert lines[1].startswith("step 10/25 loss 3.1 tok/s ")
    assert "eta 0:00:00" in lines[-1]


def test_progress_bar_on_a_terminal_shows_the_loss():
    stream = io.StringIO()
    cfg = ProgressBar.default_config().set(max_steps=4, terminal=True)
    bar = cfg.instantiate(stream=stream)
    for step in range(1, 5):
        bar.write(step, {"loss": 0.75, "tokens_per_sec": 12345.0})
    bar.close()
    out = stream.getvalue()
    assert "loss 0.75" in out and "12.35k tok/s" in out and "4/4" in out


class Recorder(SummaryWriter):
    def __init__(self, cfg=None, *, fail_close=False):
        super().__init__(cfg or SummaryWriter.Config())
        self.calls, self.fail_close = [], fail_close

    def write(self, step, scalars):
        self.calls.append(("write", step, dict(scalars)))

    def close(self):
        self.calls.append(("close",))
        if self.fail_close:
            raise RuntimeError("disk full")


def test_composite_fans_out_and_closes_every_writer_even_if_one_fails(tmp_path):
    a, b = Recorder(fail_close=True), Recorder()
    cfg = CompositeWriter.default_config().set(
        writers=[JsonlWriter.default_config().set(dir=str(tmp_path))]
    )
    writer = CompositeWriter(cfg, writers=[a, b])
    writer.write(7, {"loss": 1.0})
    with pytest.raises(RuntimeError, match="disk full"):
        writer.close()
    assert a.calls == b.calls == [("write", 7, {"loss": 1.0}), ("close",)]
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["step"] == 7
    assert CompositeWriter.of(a).writers == [a]


def test_group_tags():
    assert [group_tag(n) for n in ("loss", "eval_loss", "goodput/wall_s", "moe/x")] == [
        "train/loss",
        "eval/loss",
        "goodput/wall_s",
        "moe/x",
    ]

"""Evaluations in sight: the progress line, `axplug metrics`' table and its plots (terminal and
PNG) show eval_loss beside the training loss."""

import io
import json

import pytest
from axplug_metrics.command import (
    LOSS_LABEL,
    PNG_ROW_HEIGHT,
    PNG_WIDTH,
    merge_steps,
    panels,
    table,
    terminal_plot,
)
from axplug_testing import tiny_train_args

from axplug.cli import main
from axplug.summary import ProgressBar, read_jsonl
from axplug.summary.progress import format_progress_line

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def eval_run_records(steps: int = 20, eval_every: int = 5, checkpoint_every: int = 10) -> list:
    """The records a trainer writes: a training record per step, and at each eval step an
    eval record, before that step's training record, or after it at a checkpoint step."""
    records = []
    for step in range(1, steps + 1):
        train = {"step": step, "loss": 6.0 - 0.1 * step, "learning_rate": 1e-3, "grad_norm": 1.0}
        evaluation = {"step": step, "eval_loss": 5.5 - 0.1 * step}
        if step % eval_every == 0 and step % checkpoint_every != 0:
            records.append(evaluation)
        records.append(train)
        if step % eval_every == 0 and step % checkpoint_every == 0:
            records.append(evaluation)
    return records


def write_metrics(run_dir, records) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# --- the progress line ----------------------------------------------------------------------


def test_the_line_of_an_eval_step_shows_the_eval_loss():
    line = format_progress_line(5, 20, loss=6.043, tokens_per_sec=57200.0, eta_seconds=2,
                                evals={"eval_loss": 5.797}, eval_step=5)  # fmt: skip
    assert line == "step 5/20 loss 6.043 eval 5.797 tok/s 57.2k eta 0:00:02"
    later = format_progress_line(7, 20, loss=5.9, evals={"eval_loss": 5.797}, eval_step=5)
    assert "loss 5.9 eval@5 5.797 tok/s" in later  # the last one stays, with its step
    assert "eval" not in format_progress_line(3, 20, loss=6.0)


def test_evaluator_scalars_fit_in_the_line_or_are_counted():
    evals = {"eval_loss": 5.797, **{f"eval/task{i}/acc": 0.25 + i / 100 for i in range(20)}}
    line = format_progress_line(5, 20, loss=6.043, tokens_per_sec=1e5, eta_seconds=2,
                                evals=evals, eval_step=5, eval_details=True)  # fmt: skip
    assert line.startswith("step 5/20 loss 6.043 eval 5.797 tok/s 100k eta 0:00:02  task0/acc 0.25")
    assert len(line) <= 120 and line.endswith(" +" + line.rsplit("+", 1)[1])
    shown = line.count("/acc ")
    assert int(line.rsplit("+", 1)[1]) == 20 - shown
    only = format_progress_line(20, 20, loss=4.0, evals={"eval_loss": 4.33, "eval_acc": 0.5},
                                eval_step=20, eval_only=True)  # fmt: skip
    assert only == "step 20/20 eval 4.33  acc 0.5"


def test_progress_shows_each_evaluation_in_the_order_the_trainer_writes_them(capsys):
    cfg = ProgressBar.default_config().set(max_steps=20, every_n_steps=10, tokens_per_step=512)
    with cfg.instantiate() as bar:
        for record in eval_run_records():
            bar.write(record["step"], {k: v for k, v in record.items() if k != "step"})
    lines = capsys.readouterr().out.splitlines()
    assert "loss -" not in "\n".join(lines)
    by_step = {}
    for line in lines:
        by_step.setdefault(int(line.split()[1].split("/")[0]), []).append(line)
    assert sorted(by_step) == [1, 5, 10, 15, 20]  # eval steps print a line too
    assert by_step[5] == [by_step[5][0]] and "loss 5.5 eval 5 tok/s" in by_step[5][0]
    # At a checkpoint step the evaluation comes after the step's line: a line of its own.
    assert "loss 5 eval@5 5 tok/s" in by_step[10][0]
    assert by_step[10][1] == "step 10/20 eval 4.5"
    assert "eval 4 tok/s" in by_step[15][0] and by_step[20][1] == "step 20/20 eval 3.5"


def test_progress_bar_on_a_terminal_shows_the_eval_loss():
    stream = io.StringIO()
    bar = ProgressBar.default_config().set(max_steps=4, terminal=True).instantiate(stream=stream)
    bar.write(1, {"loss": 0.75})
    bar.write(2, {"eval_loss": 0.625})
    bar.write(2, {"loss": 0.7})
    bar.write(3, {"loss": 0.65})
    bar.close()
    out = stream.getvalue()
    assert "loss 0.7 eval 0.625" in out and "eval@2 0.625" in out and "loss -" not in out


# --- axplug metrics: the table --------------------------------------------------------------


def test_table_merges_a_steps_train_and_eval_records():
    records = eval_run_records()
    merged = merge_steps(records)
    assert [r["step"] for r in merged] == list(range(1, 21))
    assert merged[9]["loss"] == pytest.approx(5.0) and merged[9]["eval_loss"] == pytest.approx(4.5)
    lines = table(records, last=6)
    assert lines[0].split() == ["step", "loss", "eval_loss", "learning_rate", "grad_norm"]
    rows = {int(line.split()[0]): line.split() for line in lines[1:]}
    assert sorted(rows) == list(range(15, 21))  # one row per step
    assert rows[15] == ["15", "4.5", "4", "0.001", "1"]
    assert rows[16] == ["16", "4.4", "-", "0.001", "1"]
    assert rows[20][:3] == ["20", "4", "3.5"]
    # Rows without an evaluation: the last one is named under the table.
    to_18 = [r for r in records if r["step"] <= 18]
    assert table(to_18, last=3)[-1] == "last eval, at step 15: eval_loss 4"
    assert table(to_18, last=4)[-1].split()[0] == "18"


def test_metrics_command_shows_eval_values_and_overlays_them_on_the_loss(tmp_path, capsys):
    write_metrics(tmp_path / "demo", eval_run_records())
    assert main(["metrics", str(tmp_path / "demo"), "--last", "3"]) == 0
    out = capsys.readouterr().out
    table_lines = out.split("\n\n")[0].splitlines()
    assert table_lines[0].split()[:3] == ["step", "loss", "eval_loss"]
    assert table_lines[-1].split()[:3] == ["20", "4", "3.5"]
    plots = out.split("\n\n")[1:]
    loss_plot = plots[0]
    assert "demo: loss, eval_loss" in loss_plot  # one panel, titled with the run
    assert "legend:" in loss_plot and " loss " in loss_plot and "o eval_loss" in loss_plot
    assert LOSS_LABEL in loss_plot and "step" in loss_plot
    assert "3.50┤" in loss_plot and "5.90┤" in loss_plot  # one scale spans both series
    assert not any("eval_loss" in p for p in plots[1:])
    assert "(no tokens_per_sec in these records)" in out
    # --plot picks metrics; loss metrics share a panel whatever the order.
    assert main(["metrics", str(tmp_path / "demo"), "--plot", "grad_norm,eval_loss,loss"]) == 0
    plots = capsys.readouterr().out.split("\n\n")[1:]
    assert ["grad_norm" in plots[0], "loss, eval_loss" in plots[1], len(plots)] == [1, 1, 2]


def test_panels_group_the_loss_metrics_and_keep_the_others_apart():
    records = [{"step": 1, "loss": 3.0, "eval_loss": 3.1, "eval_ppl_loss": 2.0, "mfu": 0.4}]
    loss, mfu = panels(records, ["loss", "mfu", "eval_ppl_loss", "eval_loss"])
    assert loss.names == ("loss", "eval_ppl_loss", "eval_loss") and loss.ylabel == LOSS_LABEL
    assert [(s.name, s.points) for s in loss.series] == [
        ("loss", False),
        ("eval_ppl_loss", True),
        ("eval_loss", True),
    ]
    assert mfu.names == ("mfu",) and "fraction" in mfu.ylabel
    default = panels(records)  # eval losses join the default loss panel
    assert default[0].names == ("loss", "eval_loss", "eval_ppl_loss")
    assert [p.names[0] for p in panels([{"step": 1, "loss": 3.0}])] == [
        "loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_sec",
    ]


def test_terminal_plot_marks_few_points_and_names_both_series():
    records = eval_run_records()
    (loss,) = panels(records, ["loss", "eval_loss"])
    text = terminal_plot("demo", loss, 72, 12)
    assert "•" in text and "o" in text.split("legend:")[0]  # train points marked, eval points
    many = [{"step": s, "loss": 1.0 / s} for s in range(1, 200)]
    assert "•" not in terminal_plot("demo", panels(many, ["loss"])[0], 72, 12)


# --- axplug metrics: the PNG ----------------------------------------------------------------


def test_png_overlays_eval_points_on_the_training_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from axplug_metrics.command import build_figure

    records = eval_run_records()
    figure = build_figure("demo", panels(records, ["loss", "eval_loss", "grad_norm"]))
    loss_axes, grad_axes = figure.axes
    lines = {line.get_label(): line for line in loss_axes.get_lines()}
    assert set(lines) == {"loss", "eval_loss"}  # both on one axes: one scale
    assert lines["loss"].get_linestyle() == "-" and lines["loss"].get_marker() == "."
    assert lines["eval_loss"].get_linestyle() == "None" and lines["eval_loss"].get_marker() == "o"
    assert list(lines["eval_loss"].get_xdata()) == [5, 10, 15, 20]
    assert "demo" in loss_axes.get_title() and "nats/token" in loss_axes.get_ylabel()
    assert loss_axes.get_xlabel() == "step"
    legend = loss_axes.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["loss", "eval_loss"]
    assert [line.get_label() for line in grad_axes.get_lines()] == ["grad_norm"]

    write_metrics(tmp_path / "demo", records)
    png = tmp_path / "curves.png"
    assert main(["metrics", str(tmp_path / "demo"), "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    size = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert size == (PNG_WIDTH, 3 * PNG_ROW_HEIGHT)  # loss+eval, learning_rate, grad_norm


# --- a real run -----------------------------------------------------------------------------


def test_a_real_run_with_eval_every_shows_its_eval_loss(tmp_path, capsys):
    run = tmp_path / "tiny"
    args = tiny_train_args(run, "eval_every=2", "eval_batches=1", "log_every=1", max_steps=4)
    assert main([*args, "--mesh-rule", "none"]) == 0
    out = capsys.readouterr().out
    assert "loss -" not in out
    evals = {
        r["step"]: r["eval_loss"] for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r
    }
    assert sorted(evals) == [2, 4]
    step2 = [line for line in out.splitlines() if line.startswith("step 2/4 ")]
    assert len(step2) == 1 and " eval " in step2[0]
    assert main(["metrics", str(run), "--last", "4"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.split("\n\n")[0].splitlines()
    column = header.split().index("eval_loss")
    assert [row.split()[column] for row in rows] == ["-", f"{evals[2]:.4g}", "-", f"{evals[4]:.4g}"]
    assert "tiny: loss, eval_loss" in out

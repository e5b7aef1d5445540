"""`axplug metrics RUN_DIR`: a run's last records and terminal plots of its metrics."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, NamedTuple

from axplug.api import add_command

__all__ = [
    "add_parser",
    "run",
    "series",
    "merge_steps",
    "table",
    "panels",
    "Panel",
    "Series",
    "terminal_plot",
    "build_figure",
    "write_png",
]

EPILOG = """\
examples:
  axplug metrics runs/demo                        the last 5 records and plots of loss (with
                                                  eval loss, if the run evaluated), lr, grad
                                                  norm and tokens/s
  axplug metrics runs/demo --plot loss,mfu --last 10
  axplug metrics s3://bucket/run                  a bucket run's local summaries mirror
  axplug metrics runs/demo --png curves.png       the same plots as an image (matplotlib:
                                                  pip install 'axplug-metrics[png]')

The records are OUTPUT_DIR/metrics.jsonl (for s3:// and gs:// runs, its local mirror under
~/.cache/axplug/runs); the training and eval records of a step are one row of the table. The
training loss, eval_loss and other eval_*loss share one panel and one scale (nats/token):
training as a line, evaluations as points. A metric no record has is skipped with a note.
"""

DEFAULT_PLOTS = ("loss", "learning_rate", "grad_norm", "tokens_per_sec")
COLUMNS = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu")
MAX_EVAL_COLUMNS = 4  # evaluator scalars in the table beyond eval_loss; the rest are named
MARKERS_UP_TO = 50  # a line with this many points or fewer also marks each point
PNG_WIDTH, PNG_ROW_HEIGHT, PNG_DPI = 1000, 250, 100
LOSS_LABEL = "loss (nats/token)"  # mean next-token cross entropy (natural log), + aux losses
LABELS = {  # y-axis labels, with units
    "learning_rate": "learning rate",
    "grad_norm": "grad norm (global L2)",
    "tokens_per_sec": "tokens/s",
    "model_flops_per_sec": "model FLOP/s",
    "mfu": "MFU (fraction of peak)",
    "step_time": "step time (s)",
}
EVAL_MARKERS = ("o", "x", "+", "*", "#")  # terminal markers of eval series, in order
PNG_EVAL_MARKERS = ("o", "s", "^", "D", "v")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(
        subparsers,
        "metrics",
        run,
        help="a run's last metrics records and terminal plots",
        description="Print the last records of a run's metrics.jsonl and plot its metrics "
        "in the terminal.",
        epilog=EPILOG,
    )
    parser.add_argument("run_dir", help="the run's --output-dir")
    parser.add_argument("--last", type=int, default=5, help="steps to print (default 5)")
    parser.add_argument(
        "--plot",
        default=None,
        help="comma-separated metrics to plot, or 'none' (default "
        f"{','.join(DEFAULT_PLOTS)}, with the run's eval_loss beside loss); loss, eval_loss "
        "and eval_*loss share one panel",
    )
    parser.add_argument("--width", type=int, default=72, help="plot width in characters")
    parser.add_argument("--height", type=int, default=12, help="plot height in lines")
    parser.add_argument(
        "--png",
        metavar="FILE",
        help=f"also draw the plots into a PNG, {PNG_WIDTH} pixels wide and {PNG_ROW_HEIGHT} "
        "high per panel (needs matplotlib)",
    )
    return parser


def series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name` over the records that have a finite value of it."""
    steps, values = [], []
    for record in records:
        value = record.get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def merge_steps(records: list[dict]) -> list[dict]:
    """One record per step, in the order of first appearance: a step's training record and
    the record of its evaluation (written separately) merged."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(int(record["step"]), {}).update(record)
    return list(merged.values())


def _is_eval(name: str) -> bool:
    from axplug.api.summary import is_eval_name

    return is_eval_name(name)


def _is_loss(name: str) -> bool:
    """The metrics drawn on the loss panel: `loss`, `eval_loss` and any `eval_*loss`."""
    return name == "loss" or (name.startswith("eval_") and name.endswith("loss"))


def _cell(value: Any) -> str:
    if isinstance(value, int | float):
        from axplug.api.summary import format_scalar

        return format_scalar(float(value))
    return "-" if value is None else str(value)


def table(records: list[dict], last: int) -> list[str]:
    """The lines of the table of the last `last` steps (training and eval records merged),
    then a note of the last evaluation when none of those steps evaluated."""
    rows_of = merge_steps(records)
    names = list(dict.fromkeys(k for r in rows_of for k in r))
    extra_evals = [n for n in names if _is_eval(n) and n not in COLUMNS]
    columns = [c for c in COLUMNS if c in names] + extra_evals[:MAX_EVAL_COLUMNS]
    shown = rows_of[-last:]
    rows = [("step", *columns)]
    rows += [(str(r["step"]), *(_cell(r.get(c)) for c in columns)) for r in shown]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    if len(extra_evals) > MAX_EVAL_COLUMNS:
        more = extra_evals[MAX_EVAL_COLUMNS:]
        lines.append(f"({len(more)} more eval metrics: {', '.join(more)}; --plot NAME shows one)")
    evaluated = [r for r in rows_of if any(_is_eval(k) for k in r)]
    if evaluated and not any(any(_is_eval(k) for k in r) for r in shown):
        record = evaluated[-1]
        values = ", ".join(f"{k} {_cell(v)}" for k, v in record.items() if _is_eval(k))
        lines.append(f"last eval, at step {record['step']}: {values}")
    return lines


class Series(NamedTuple):
    name: str
    steps: list[int]
    values: list[float]
    points: bool  # sparse (an evaluation's): points only, no line


class Panel(NamedTuple):
    names: tuple[str, ...]  # the metrics asked for, whether the records have them or not
    ylabel: str  # with the unit: `loss (nats/token)`
    series: list[Series]  # those the records have


def _ylabel(name: str) -> str:
    return LOSS_LABEL if _is_loss(name) else LABELS.get(name, name)


def panels(records: list[dict], names: list[str] | None = None) -> list[Panel]:
    """The panels of the metrics `names` (None: the defaults, with the run's eval losses next
    to `loss`): the loss metrics on one, each other metric on its own, in order."""
    if names is None:
        present = list(dict.fromkeys(k for r in records for k in r))
        names = [*DEFAULT_PLOTS]
        names[1:1] = [n for n in present if _is_loss(n) and n != "loss"]
    out: list[Panel] = []
    drawn_loss: set[str] = set()
    loss_names = tuple(sorted(dict.fromkeys(n for n in names if _is_loss(n)), key=_is_eval))
    for name in dict.fromkeys(names):
        if _is_loss(name) and name in drawn_loss:
            continue  # on the panel of the first loss metric asked for
        group = loss_names if _is_loss(name) else (name,)
        if _is_loss(name):
            drawn_loss.update(loss_names)
        drawn = []
        for metric in group:
            steps, values = series(records, metric)
            if steps:
                drawn.append(Series(metric, steps, values, points=_is_eval(metric)))
        out.append(Panel(group, _ylabel(name), drawn))
    return out


def _int_ticks(steps: list[int], count: int = 5) -> list[int]:
    lo, hi = min(steps), max(steps)
    if hi - lo < count:
        return list(range(lo, hi + 1))
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def terminal_plot(run_name: str, panel: Panel, width: int, height: int) -> str:
    """A panel in the terminal (plotext): training metrics as lines, marked at each point when
    there are few, evaluations as points; a legend line under the axes."""
    import plotext as plt

    plt.clear_figure()
    plt.theme("clear")
    plt.plotsize(width, height)
    legend, markers = [], iter(EVAL_MARKERS)
    for s in panel.series:
        if s.points:
            marker = next(markers, "o")
            plt.scatter(s.steps, s.values, marker=marker)
            legend.append(f"{marker} {s.name}")
        else:
            plt.plot(s.steps, s.values, marker="braille")
            if len(s.steps) <= MARKERS_UP_TO:
                plt.scatter(s.steps, s.values, marker="•")
                legend.append(f"⠤•⠤ {s.name}")
            else:
                legend.append(f"⠤⠤ {s.name}")
    ticks = _int_ticks(sorted({step for s in panel.series for step in s.steps}))
    plt.xticks(ticks, [str(t) for t in ticks])
    plt.title(f"{run_name}: {', '.join(s.name for s in panel.series)}")
    plt.xlabel("step")
    plt.ylabel(panel.ylabel)
    chart = plt.uncolorize(plt.build()).rstrip("\n")
    return f"{chart}\n    legend: {'   '.join(legend)}"


def build_figure(run_name: str, drawn: list[Panel]) -> Any:
    """A matplotlib Figure of the panels, one row each, PNG_WIDTH x PNG_ROW_HEIGHT pixels:
    training metrics as lines (marked at each point when there are few), evaluations as
    points, on one axes per panel with a title naming the run, units and a legend."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = len(drawn)
    fig = Figure(figsize=(PNG_WIDTH / PNG_DPI, rows * PNG_ROW_HEIGHT / PNG_DPI), dpi=PNG_DPI)
    axes = fig.subplots(rows, 1, squeeze=False)
    for ax, panel in zip(axes[:, 0], drawn, strict=True):
        markers = iter(PNG_EVAL_MARKERS)
        for s in panel.series:
            if s.points:
                ax.plot(s.steps, s.values, linestyle="none", marker=next(markers, "o"),
                        markersize=5, label=s.name, zorder=3)  # fmt: skip
            else:
                few = len(s.steps) <= MARKERS_UP_TO
                ax.plot(s.steps, s.values, linewidth=1.2, marker="." if few else None,
                        markersize=4, label=s.name)  # fmt: skip
        ax.set_title(f"{run_name}: {', '.join(s.name for s in panel.series)}", fontsize=9)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def write_png(path: str, run_name: str, drawn: list[Panel]) -> None:
    """`build_figure` saved as a PNG: one PNG_WIDTH x PNG_ROW_HEIGHT row per panel."""
    build_figure(run_name, drawn).savefig(path, dpi=PNG_DPI)


def run_name_of(run_dir: str) -> str:
    """The name plots are titled with: the run directory's last component."""
    return os.path.basename(run_dir.rstrip("/")) or run_dir


def run(args: argparse.Namespace) -> int:
    from axplug.api import AxplugError
    from axplug.api.config import ConfigDependencyError, UsageError
    from axplug.api.run import summary_dir
    from axplug.api.summary import read_jsonl

    for flag in ("last", "width", "height"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    path = f"{summary_dir(args.run_dir).rstrip('/')}/metrics.jsonl"
    records = read_jsonl(path)
    if not records:
        raise AxplugError(f"no metrics records in {path} (is it a run dir?)")
    for line in table(records, args.last):
        print(line)
    if args.plot is None:
        names = None
    elif args.plot == "none":
        names = []
    else:
        names = [n.strip() for n in args.plot.split(",") if n.strip()]
    run_name = run_name_of(args.run_dir)
    drawn = []
    for panel in panels(records, names):
        have = {s.name for s in panel.series}
        for name in panel.names:
            if name not in have:
                print(f"\n(no {name} in these records)")
        if panel.series:
            drawn.append(panel)
            print()
            print(terminal_plot(run_name, panel, args.width, args.height))
    if args.png:
        if not drawn:
            raise AxplugError("--png: nothing to plot")
        try:
            write_png(args.png, run_name, drawn)
        except ImportError:
            raise ConfigDependencyError(
                "--png needs matplotlib: pip install 'axplug-metrics[png]'"
            ) from None
        print(f"\nwrote {args.png}")
    return 0

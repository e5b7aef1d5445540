"""`axplug metrics RUN_DIR`: a run's last records and terminal plots of its metrics."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

__all__ = ["add_parser", "run", "series"]

EPILOG = """\
examples:
  axplug metrics runs/demo                        the last 5 records and plots of loss, lr,
                                                  grad norm and tokens/s
  axplug metrics runs/demo --plot loss,mfu --last 10
  axplug metrics s3://bucket/run                  a bucket run's local summaries mirror
  axplug metrics runs/demo --png curves.png       the same plots as an image (matplotlib:
                                                  pip install 'axplug[plots]')

The records are OUTPUT_DIR/metrics.jsonl (for s3:// and gs:// runs, its local mirror under
~/.cache/axplug/runs). A metric no record has is skipped with a note.
"""

DEFAULT_PLOTS = ("loss", "learning_rate", "grad_norm", "tokens_per_sec")
COLUMNS = ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu")
PNG_WIDTH, PNG_ROW_HEIGHT, PNG_DPI = 1000, 250, 100


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "metrics",
        help="a run's last metrics records and terminal plots",
        description="Print the last records of a run's metrics.jsonl and plot its metrics "
        "in the terminal.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the run's --output-dir")
    parser.add_argument("--last", type=int, default=5, help="records to print (default 5)")
    parser.add_argument(
        "--plot",
        default=",".join(DEFAULT_PLOTS),
        help=f"comma-separated metrics to plot, or 'none' (default {','.join(DEFAULT_PLOTS)})",
    )
    parser.add_argument("--width", type=int, default=72, help="plot width in characters")
    parser.add_argument("--height", type=int, default=12, help="plot height in lines")
    parser.add_argument(
        "--png",
        metavar="FILE",
        help=f"also draw the plots into a PNG, {PNG_WIDTH} pixels wide and {PNG_ROW_HEIGHT} "
        "high per metric (needs matplotlib)",
    )
    parser.set_defaults(run=run)
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


def _cell(value: Any) -> str:
    if isinstance(value, int | float):
        from axplug.summary.base import format_scalar

        return format_scalar(float(value))
    return "-" if value is None else str(value)


def _plot(name: str, steps: list[int], values: list[float], width: int, height: int) -> str:
    import plotext as plt

    plt.clear_figure()
    plt.theme("clear")
    plt.plotsize(width, height)
    plt.plot(steps, values)
    plt.title(name)
    plt.xlabel("step")
    return plt.uncolorize(plt.build())


def run(args: argparse.Namespace) -> int:
    from axplug.summary import read_jsonl
    from axplug.trainer.summaries import summary_dir

    for flag in ("last", "width", "height"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag} must be >= 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    path = f"{summary_dir(args.run_dir).rstrip('/')}/metrics.jsonl"
    records = read_jsonl(path)
    if not records:
        print(f"error: no metrics records in {path} (is it a run dir?)", file=sys.stderr)
        return 1
    columns = [c for c in COLUMNS if any(c in r for r in records)]
    rows = [("step", *columns)]
    rows += [(str(r["step"]), *(_cell(r.get(c)) for c in columns)) for r in records[-args.last :]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    names = [] if args.plot == "none" else [n.strip() for n in args.plot.split(",") if n.strip()]
    plotted = {}
    for name in names:
        steps, values = series(records, name)
        if not steps:
            print(f"\n(no {name} in these records)")
            continue
        plotted[name] = (steps, values)
        print()
        print(_plot(name, steps, values, args.width, args.height))
    if args.png:
        if not plotted:
            print("error: --png: nothing to plot", file=sys.stderr)
            return 1
        try:
            write_png(args.png, plotted)
        except ImportError:
            print("error: --png needs matplotlib: pip install 'axplug[plots]'", file=sys.stderr)
            return 2
        print(f"\nwrote {args.png}")
    return 0


def write_png(path: str, plotted: dict[str, tuple[list[int], list[float]]]) -> None:
    """One row per metric, PNG_WIDTH x PNG_ROW_HEIGHT pixels each."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = len(plotted)
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(PNG_WIDTH / PNG_DPI, rows * PNG_ROW_HEIGHT / PNG_DPI),
        dpi=PNG_DPI,
        squeeze=False,
    )
    for ax, (name, (steps, values)) in zip(axes[:, 0], plotted.items(), strict=True):
        ax.plot(steps, values)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=PNG_DPI)
    plt.close(fig)

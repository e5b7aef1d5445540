"""Summary writers: per-step scalars to JSON lines, TensorBoard and the terminal; plugins add
more under the `axplug.summary_writers` entry-point group (`--writer NAME`)."""

from axplug.summary.base import (
    CompositeWriter,
    SummaryWriter,
    format_scalar,
    group_tag,
    is_eval_name,
    to_scalars,
)
from axplug.summary.jsonl import JsonlWriter, read_jsonl
from axplug.summary.progress import ProgressBar
from axplug.summary.tensorboard import TensorBoardWriter

__all__ = [
    "SummaryWriter",
    "CompositeWriter",
    "JsonlWriter",
    "TensorBoardWriter",
    "ProgressBar",
    "read_jsonl",
    "to_scalars",
    "group_tag",
    "is_eval_name",
    "format_scalar",
]

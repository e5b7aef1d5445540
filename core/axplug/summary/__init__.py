"""Summary writers: per-step scalars to JSON lines and the terminal; plugins add more
(TensorBoard, W&B, MLflow) under the `axplug.summary_writers` entry-point group
(`--writer NAME`)."""

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

__all__ = [
    "SummaryWriter",
    "CompositeWriter",
    "JsonlWriter",
    "ProgressBar",
    "read_jsonl",
    "to_scalars",
    "group_tag",
    "is_eval_name",
    "format_scalar",
]

"""Summary writers: per-step scalars to JSON lines, TensorBoard and the terminal."""

from axplug.summary.base import CompositeWriter, SummaryWriter, to_scalars
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
]

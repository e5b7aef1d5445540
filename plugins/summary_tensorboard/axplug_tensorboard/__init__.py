"""TensorBoard summary writer for axplug (`--writer tensorboard`)."""

from axplug_tensorboard.writer import TensorBoardWriter

__all__ = ["TensorBoardWriter"]

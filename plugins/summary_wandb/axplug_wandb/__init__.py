"""Weights & Biases summary writer for axplug (`--writer wandb`)."""

from axplug_wandb.writer import WandbWriter

__all__ = ["WandbWriter"]

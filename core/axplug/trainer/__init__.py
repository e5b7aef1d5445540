"""Training: the Trainer, its pure step, the aux-loss rule and hook running."""

from axplug.trainer.aux_losses import AuxLossRule
from axplug.trainer.compilation import enable_compilation_cache
from axplug.trainer.hooks import HookRunner
from axplug.trainer.loop_state import NonFiniteError
from axplug.trainer.step import build_eval_step, build_train_step
from axplug.trainer.trainer import Trainer, summary_dir

__all__ = [
    "AuxLossRule",
    "HookRunner",
    "NonFiniteError",
    "Trainer",
    "build_eval_step",
    "build_train_step",
    "enable_compilation_cache",
    "summary_dir",
]

"""Training: the Trainer, its pure step, the aux-loss rule, hook running and the FLOP model."""

from axplug.trainer.aux_losses import AuxLossRule
from axplug.trainer.compilation import compilation_cache
from axplug.trainer.flops import active_parameters, analytic_flops, model_flops_per_step
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
    "compilation_cache",
    "summary_dir",
    "active_parameters",
    "analytic_flops",
    "model_flops_per_step",
]

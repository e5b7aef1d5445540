"""Training: the Trainer, its pure step, the aux-loss rule, hook running and the FLOP model."""

from axplug.trainer.aux_losses import AuxLossRule, collect_outputs
from axplug.trainer.compilation import compilation_cache
from axplug.trainer.flops import active_parameters, analytic_flops, model_flops_per_step
from axplug.trainer.hooks import HookRunner
from axplug.trainer.init_from import restore_weights
from axplug.trainer.loop_state import NonFiniteError
from axplug.trainer.run import train
from axplug.trainer.step import build_eval_step, build_train_step, loss_fn
from axplug.trainer.trainable import parameter_paths
from axplug.trainer.trainer import Trainer, summary_dir

__all__ = [
    "AuxLossRule",
    "HookRunner",
    "NonFiniteError",
    "Trainer",
    "train",
    "loss_fn",
    "collect_outputs",
    "restore_weights",
    "parameter_paths",
    "build_eval_step",
    "build_train_step",
    "compilation_cache",
    "summary_dir",
    "active_parameters",
    "analytic_flops",
    "model_flops_per_step",
]

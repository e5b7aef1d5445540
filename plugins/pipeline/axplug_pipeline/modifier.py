"""The `pipeline` modifier: the layer stack as pipeline stages."""

from __future__ import annotations

from axplug.api.config import ConfigBase, ConfigModifier, config_class, find_configs, replace_config
from axplug.api.layers import RepeatedTransformer, StackedTransformer
from axplug_pipeline.layer import PipelinedTransformer

__all__ = ["PipelineModifier"]


class PipelineModifier(ConfigModifier):
    """Runs the layer stack as pipeline stages, e.g. `pipeline:stages=4,microbatches=8`.

    `schedule`: `gpipe`; `circular` with `repeats` virtual stages per device (a smaller
    bubble); `1f1b` (activation memory bounded by the stages, not the microbatches); `zbh1`
    (zero-bubble ZB-H1: 1F1B with the weights' gradients filling the bubble). Put the
    stages on devices with `mesh:pipeline=<stages>`. The parameters keep the scanned stack's
    tree, so checkpoints move between pipelined and scanned runs.
    """

    @config_class
    class Config(ConfigModifier.Config):
        stages: int = 2
        microbatches: int = 4
        schedule: str = "gpipe"
        repeats: int = 2
        remat_policy: str | None = None  # None: keep the stack's

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        new = PipelinedTransformer.default_config().set(
            num_stages=c.stages,
            num_microbatches=c.microbatches,
            schedule=c.schedule,
            num_repeats=c.repeats,
        )
        owned = ["num_stages", "num_microbatches", "schedule", "num_repeats"]
        if c.remat_policy is not None:
            new.remat_policy = c.remat_policy
            owned.append("remat_policy")
        for target in (PipelinedTransformer, RepeatedTransformer):
            if find_configs(cfg, target):
                return replace_config(cfg, target=target, new_cfg=new, carry=["layer"], owned=owned)
        return replace_config(cfg, target=StackedTransformer, new_cfg=new, owned=owned)

"""The `mtp` modifier: a model's CausalLM trained with multi-token prediction modules."""

from __future__ import annotations

import copy

from axplug.api.config import ConfigBase, ConfigError, ConfigModifier, config_class, replace_config
from axplug.api.layers import CausalLM
from axplug_mtp.layer import MTPModule, MultiTokenPredictionLM

__all__ = ["MTPModifier"]


class MTPModifier(ConfigModifier):
    """`mtp`, `mtp:depth=2,loss_weight=0.3`: the model's `CausalLM` becomes a
    `MultiTokenPredictionLM` with `depth` modules, each's block a copy of the stack's layer
    (DeepSeek-V3: an MoE layer) and its norms the stack's norm."""

    positional_option = "depth"

    @config_class
    class Config(ConfigModifier.Config):
        depth: int = 1
        loss_weight: float = 0.3

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        if c.depth < 1 or not c.loss_weight >= 0:
            raise ConfigError(
                f"modifier mtp: depth={c.depth} must be >= 1 and loss_weight={c.loss_weight} >= 0"
            )
        cfg = replace_config(
            cfg, target=MultiTokenPredictionLM, new_cfg=CausalLM.default_config(),
            missing_ok=True,
        )  # fmt: skip
        model = cfg.model if hasattr(cfg, "model") else cfg
        stack = getattr(model, "decoder", None) and model.decoder.transformer
        layer = getattr(stack, "layer", None)
        if layer is None:
            raise ConfigError(
                "modifier mtp: the model has no decoder stack with a `layer` to copy into the "
                "prediction modules; it applies to CausalLM models"
            )
        module = MTPModule.default_config().set(
            block=copy.deepcopy(layer), norm=copy.deepcopy(layer.norm)
        )
        new = MultiTokenPredictionLM.default_config().set(
            depth=c.depth, loss_weight=c.loss_weight, module=module
        )
        return replace_config(cfg, target=CausalLM, new_cfg=new, carry=["decoder"])

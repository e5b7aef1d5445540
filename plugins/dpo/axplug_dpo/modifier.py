"""The `dpo` modifier: the model's CausalLM trained with a preference loss."""

from __future__ import annotations

from axplug.api.config import ConfigBase, ConfigError, ConfigModifier, config_class, replace_config
from axplug.api.layers import CausalLM
from axplug_dpo.loss import LOSSES
from axplug_dpo.model import DPOCausalLM

__all__ = ["DPOModifier"]


class DPOModifier(ConfigModifier):
    """`dpo`, `dpo:beta=0.1,loss=ipo`, `dpo:loss=simpo,simpo_gamma=0.5`: the model's
    `CausalLM` becomes a `DPOCausalLM` (the same parameters). Train it on `--input
    preferences:path=DIR` (pairs from `axplug prepare-preferences`, reference log-probabilities
    from `axplug dpo-reference`), usually `--from` the model the reference was computed with;
    with `--modifier lora` only the adapters train."""

    positional_option = "loss"

    @config_class
    class Config(ConfigModifier.Config):
        beta: float = 0.1
        loss: str = "sigmoid"
        simpo_gamma: float = 0.5

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        if c.loss not in LOSSES:
            raise ConfigError(f"modifier dpo: loss {c.loss!r}; choose from {LOSSES}")
        if c.beta <= 0:
            raise ConfigError(f"modifier dpo: beta must be > 0, got {c.beta}")
        new = DPOCausalLM.default_config().set(beta=c.beta, loss=c.loss, simpo_gamma=c.simpo_gamma)
        cfg = replace_config(
            cfg, target=DPOCausalLM, new_cfg=CausalLM.default_config(), missing_ok=True
        )
        return replace_config(cfg, target=CausalLM, new_cfg=new, carry=["decoder"])

"""The `grpo` modifier: the model's CausalLM trained with a GRPO-family policy loss."""

from __future__ import annotations

from axplug.api.config import ConfigBase, ConfigError, ConfigModifier, config_class, replace_config
from axplug.api.layers import CausalLM
from axplug_rl.loss import LOSSES
from axplug_rl.model import PolicyCausalLM

__all__ = ["GRPOModifier"]


class GRPOModifier(ConfigModifier):
    """`grpo`, `grpo:dapo`, `grpo:loss=gspo,kl_beta=0.04`: the model's `CausalLM` becomes a
    `PolicyCausalLM` (the same parameters) with that loss; train it on `--input
    rollouts:prompts=FILE,...`, usually `--from` a run; with `--modifier lora` only the
    adapters train (and `reference=adapters_off` is the KL reference at no memory cost)."""

    positional_option = "loss"

    @config_class
    class Config(ConfigModifier.Config):
        loss: str = "grpo"
        clip_low: float | None = None
        clip_high: float | None = None
        advantage_scale: str | None = None
        advantage_eps: float = 1e-4
        kl_beta: float = 0.0
        max_tokens: int | None = None
        tis_cap: float | None = None

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        if c.loss not in LOSSES:
            raise ConfigError(f"modifier grpo: loss {c.loss!r}; choose from {LOSSES}")
        new = PolicyCausalLM.default_config()
        fields = set(new.keys()) - {"klass"}
        new.set(**{k: v for k, v in c.items() if k in fields})
        cfg = replace_config(
            cfg, target=PolicyCausalLM, new_cfg=CausalLM.default_config(), missing_ok=True
        )
        return replace_config(cfg, target=CausalLM, new_cfg=new, carry=["decoder"])

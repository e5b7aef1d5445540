"""The `lora` modifier: low-rank adapters on the chosen Linear layers, everything else frozen."""

from __future__ import annotations

from axplug.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    config_class,
    find_configs,
    replace_config,
)
from axplug.layers import Linear
from axplug_lora.layer import LoRALinear

__all__ = ["LoRAModifier", "TRAINABLE"]

# learner.trainable under LoRA: the adapters only.
TRAINABLE = r"/lora_[ab]$"


class LoRAModifier(ConfigModifier):
    """`lora:rank=8,alpha=16,targets=attention+feed_forward,dropout=0.05`.

    Adapts every `Linear` under `targets`: components of its path (`attention`,
    `feed_forward`, `output`, `lm_head`) or a projection's own name (`q`, `k`, `v`, `wi_gate`,
    `wi_up`, `wo`: a `LoRALinear` whose `modules` names them) . It
    sets `learner.trainable` so that only the adapters train: the base weights get no
    gradient and no optimizer state. Applied again, the new options replace the old.
    """

    positional_option = "rank"

    @config_class
    class Config(ConfigModifier.Config):
        rank: int = 8
        alpha: float = 16.0
        dropout: float = 0.0
        targets: tuple[str, ...] = ("attention", "feed_forward")

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        if c.rank < 1:
            raise ConfigError(f"modifier lora: rank must be >= 1, got {c.rank}")
        if not 0.0 <= c.dropout < 1.0:
            raise ConfigError(f"modifier lora: dropout must be in [0, 1), got {c.dropout}")
        targets = set(c.targets)
        # Back to plain Linear layers first, so re-applying with other targets replaces them.
        cfg = replace_config(
            cfg, target=LoRALinear, new_cfg=Linear.default_config(), missing_ok=True
        )
        new = LoRALinear.default_config().set(rank=c.rank, alpha=c.alpha, dropout=c.dropout)
        matched = [p for p, _ in find_configs(cfg, Linear) if targets & set(p.split("."))]
        cfg = replace_config(
            cfg,
            target=Linear,
            new_cfg=new,
            where=lambda path, _old: bool(targets & set(path.split("."))),
            missing_ok=True,
        )
        # The transformer's other Linear configs build several projections each (q, k and v
        # from one): adapted where a module's own name is a target.
        per_module = [p for p, v in find_configs(cfg, Linear)
                      if v.klass is Linear and "transformer" in p.split(".")]  # fmt: skip
        if not matched and not per_module:
            raise ConfigError(
                f"modifier lora: targets {sorted(targets)} match no Linear layer; name path "
                "components such as attention or feed_forward, or projections such as q, v, wo"
            )
        cfg = replace_config(
            cfg,
            target=Linear,
            new_cfg=new.clone(modules=tuple(sorted(targets))),
            where=lambda path, old: old.klass is Linear and "transformer" in path.split("."),
            missing_ok=True,
        )
        if "learner" in set(cfg.keys()):  # a trainer config
            cfg = cfg.clone(learner=cfg.learner.clone(trainable=TRAINABLE))
        return cfg

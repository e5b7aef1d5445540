"""The `lora` modifier: low-rank adapters on the chosen Linear layers, everything else frozen."""

from __future__ import annotations

from axplug.api.config import ConfigBase, ConfigError, ConfigModifier, config_class, visit
from axplug.api.layers import Linear
from axplug_lora.layer import LoRAAdapter

__all__ = ["LoRAModifier", "TRAINABLE"]

# learner.trainable under LoRA: the adapters only.
TRAINABLE = r"/adapter/lora_[ab]$"


class LoRAModifier(ConfigModifier):
    """`lora:rank=8,alpha=16,targets=attention+feed_forward,dropout=0.05,within=decoder`, or
    `lora:none`.

    Puts a `LoRAAdapter` in the `adapter` slot of every `Linear` (a quantized one included)
    under `targets`: components of its path (`attention`, `feed_forward`, `output`,
    `lm_head`) or a projection's own name (`q`, `k`, `v`, `wi_gate`, `wi_up`, `wo`: one
    config builds q, k and v, so those name the modules that get one). It sets
    `learner.trainable` so that only the adapters train: the base gets no gradient and no
    optimizer state. `within` keeps the adapters to the layers under a config of that name
    (`decoder`: a vision-language model's language model, not its vision tower). Applied
    again, the new options replace the old; `lora:none` removes them.
    """

    positional_option = "rank"

    @config_class
    class Config(ConfigModifier.Config):
        rank: int | None = 8  # None (`lora:none`): no adapters
        alpha: float = 16.0
        dropout: float = 0.0
        targets: tuple[str, ...] = ("attention", "feed_forward")
        within: str | None = None  # a component of the adapted layers' config paths

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        rank = 0 if c.rank is None else c.rank
        if rank < 0:
            raise ConfigError(f"modifier lora: rank must be an int >= 1 (or none), got {c.rank!r}")
        if not 0.0 <= c.dropout < 1.0:
            raise ConfigError(f"modifier lora: dropout must be in [0, 1), got {c.dropout}")
        targets = set(c.targets)
        cfg = cfg.clone()
        adapter = LoRAAdapter.default_config().set(rank=rank, alpha=c.alpha, dropout=c.dropout)
        linears = []

        def collect(path: str, value) -> None:
            klass = getattr(value, "klass", None)
            linear = isinstance(klass, type) and issubclass(klass, Linear)  # quantized too
            if linear and ("lm_head" not in path.split(".") or "lm_head" in targets):
                linears.append((path, value))

        visit(cfg, collect)
        chosen = 0
        for path, linear in linears:
            parts = set(path.split("."))
            if rank == 0 or (c.within is not None and c.within not in parts):
                linear.adapter = None
            elif targets & parts:  # the whole config (every module it builds)
                linear.adapter = adapter.clone()
                chosen += 1
            elif "transformer" in parts:  # its modules by name
                linear.adapter = adapter.clone(modules=tuple(sorted(targets)))
                chosen += 1
            else:
                linear.adapter = None
        if rank and not chosen:
            raise ConfigError(
                f"modifier lora: targets {sorted(targets)} match no Linear layer"
                + (f" within {c.within!r}" if c.within is not None else "")
                + "; name path components such as attention or feed_forward, or projections "
                "such as q, v, wo"
            )
        if "learner" in set(cfg.keys()):  # a trainer config
            trainable = TRAINABLE if rank else None
            cfg = cfg.clone(learner=cfg.learner.clone(trainable=trainable))
        return cfg

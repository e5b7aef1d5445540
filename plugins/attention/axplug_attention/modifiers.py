"""Modifiers that turn every attention layer of any config tree into RoPE / GQA /
sliding-window / ALiBi attention: `rope:theta=500000`, `gqa:num_kv_heads=8`,
`sliding_window:size=4096`, `alibi`. Re-applying one sets every option it owns, given or
default (the rule in docs/plugin-reference.md).
`flash_attention` is the core's (`axplug.kernels`), re-exported here for existing imports."""

from __future__ import annotations

import copy

from axplug.api.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    InstantiableConfig,
    config_class,
    find_configs,
    replace_config,
)
from axplug.api.layers import (
    Attention,
    FlashAttentionModifier,
    IdentityPositionTransform,
    QKVLinear,
)
from axplug_attention.alibi import alibi_slopes
from axplug_attention.gqa import GroupedQKVLinear
from axplug_attention.rope import RotaryPositionTransform

__all__ = [
    "RopeModifier",
    "GQAModifier",
    "FlashAttentionModifier",
    "SlidingWindowModifier",
    "AlibiModifier",
]


def _swap(
    cfg: ConfigBase,
    *,
    modifier: str,
    target: type,
    new_cfg: InstantiableConfig,
    again: type,
    fields: dict,
) -> ConfigBase:
    """Replaces every `target` sub-config by `new_cfg` (carrying shared fields) and sets
    `fields` on every `again` sub-config (a second application of the same modifier)."""
    if not find_configs(cfg, target) and not find_configs(cfg, again):
        raise ConfigError(
            f"modifier {modifier!r}: the config has no {target.__qualname__} (or "
            f"{again.__qualname__}) to replace; it applies to axplug.layers.Attention slots"
        )
    cfg = replace_config(cfg, target=target, new_cfg=new_cfg, missing_ok=True)
    return _update(cfg, again, fields)


def _update(cfg: ConfigBase, target: type, fields: dict) -> ConfigBase:
    """A copy of `cfg` with `fields` set on every sub-config of class `target`."""
    cfg = copy.deepcopy(cfg)
    for _, sub in find_configs(cfg, target):
        sub.set(**copy.deepcopy(fields))
    return cfg


class RopeModifier(ConfigModifier):
    """Rotary position embedding in every attention layer (applied again: updates it)."""

    @config_class
    class Config(ConfigModifier.Config):
        theta: float = 10000.0
        rotary_fraction: float = 1.0
        interleaved: bool = False
        scaling_factor: float | None = None  # Llama 3.1 long context: 8.0
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_position: int = 8192
        linear_scaling_factor: float | None = None  # linear position interpolation

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        fields = dict(
            theta=float(c.theta),
            rotary_fraction=float(c.rotary_fraction),
            interleaved=c.interleaved,
            scaling_factor=None if c.scaling_factor is None else float(c.scaling_factor),
            low_freq_factor=float(c.low_freq_factor),
            high_freq_factor=float(c.high_freq_factor),
            original_max_position=c.original_max_position,
            linear_scaling_factor=(
                None if c.linear_scaling_factor is None else float(c.linear_scaling_factor)
            ),
        )
        rope = RotaryPositionTransform.default_config().set(**fields)
        return _swap(
            cfg,
            modifier="rope",
            target=IdentityPositionTransform,
            new_cfg=rope,
            again=RotaryPositionTransform,
            fields=fields,
        )


class GQAModifier(ConfigModifier):
    """Grouped-query attention with `num_kv_heads` key/value heads (1: multi-query)."""

    @config_class
    class Config(ConfigModifier.Config):
        num_kv_heads: int = 1

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        n = self._config.num_kv_heads
        for path, attention in find_configs(cfg, Attention):
            heads = attention.num_heads
            if n < 1 or isinstance(heads, int) and heads % n:
                where = f"{path}.num_heads" if path else "num_heads"
                raise ConfigError(f"modifier 'gqa': num_kv_heads={n} must divide {where}={heads}")
        qkv = GroupedQKVLinear.default_config().set(num_kv_heads=n)
        return _swap(
            cfg,
            modifier="gqa",
            target=QKVLinear,
            new_cfg=qkv,
            again=GroupedQKVLinear,
            fields={"num_kv_heads": n},
        )


class SlidingWindowModifier(ConfigModifier):
    """Every attention layer sees only the last `size` positions (itself included)."""

    @config_class
    class Config(ConfigModifier.Config):
        size: int = 4096

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        if self._config.size < 1:
            raise ConfigError(f"modifier 'sliding_window': size={self._config.size} must be >= 1")
        if not find_configs(cfg, Attention):
            raise ConfigError("modifier 'sliding_window': the config has no Attention layer")
        return _update(cfg, Attention, {"sliding_window": self._config.size})


class AlibiModifier(ConfigModifier):
    """ALiBi in every attention layer: head h's scores get -slope_h * |q_pos - kv_pos|."""

    @config_class
    class Config(ConfigModifier.Config):
        max_bias: float = 8.0  # slopes 2^(-max_bias * i / heads); 0 turns the bias off

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        max_bias = float(self.config.max_bias)
        if max_bias < 0:
            raise ConfigError(f"modifier 'alibi': max_bias={max_bias} must be >= 0")
        attentions = find_configs(cfg, Attention)
        if not attentions:
            raise ConfigError("modifier 'alibi': the config has no Attention layer")
        cfg = copy.deepcopy(cfg)
        for path, attention in find_configs(cfg, Attention):
            heads = attention.num_heads
            if not isinstance(heads, int):
                where = f"{path}.num_heads" if path else "num_heads"
                raise ConfigError(f"modifier 'alibi': {where} is not set; set it first")
            # Per-head slopes, so the kernels that take a bias (reference, xla, blockwise,
            # cuDNN) stay selectable; max_bias=0: no bias at all.
            attention.linear_bias_slopes = alibi_slopes(heads, max_bias) if max_bias else None
        return cfg

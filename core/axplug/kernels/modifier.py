"""The `flash_attention` modifier: every attention kernel slot becomes `FlashAttention`.

It lives in the core because the hardware plugins' mesh rules name it, and they depend on
`axplug` alone.
"""

from __future__ import annotations

import copy

from axplug.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    config_class,
    find_configs,
    replace_config,
)
from axplug.kernels.layer import FlashAttention
from axplug.layers import DotProductKernel

__all__ = ["FlashAttentionModifier"]


class FlashAttentionModifier(ConfigModifier):
    """Every attention kernel dispatches to the best registered kernel for the backend."""

    @config_class
    class Config(ConfigModifier.Config):
        kernels: list[str] | None = None  # try only these, in order
        backend: str | None = None

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        fields = {"kernels": copy.copy(self._config.kernels), "backend": self._config.backend}
        if not find_configs(cfg, DotProductKernel) and not find_configs(cfg, FlashAttention):
            raise ConfigError(
                "modifier 'flash_attention': the config has no DotProductKernel (or "
                "FlashAttention) to replace; it applies to axplug.layers.Attention slots"
            )
        flash = FlashAttention.default_config().set(**fields)
        cfg = replace_config(cfg, target=DotProductKernel, new_cfg=flash, missing_ok=True)
        # Applied again: the slots it already filled take the new fields.
        cfg = copy.deepcopy(cfg)
        for _, sub in find_configs(cfg, FlashAttention):
            sub.set(**copy.deepcopy(fields))
        return cfg

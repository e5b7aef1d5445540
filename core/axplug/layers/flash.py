"""The flash-attention slot: `FlashAttention` runs the best registered kernel,
`BlockwiseAttention` always the memory-efficient blockwise one, and the `flash_attention`
modifier puts `FlashAttention` into every softmax kernel slot.

The modifier lives in the core because the hardware plugins' mesh rules name it, and they
depend on `axplug` alone.
"""

from __future__ import annotations

import copy
import logging
import math

import jax

from axplug import registry
from axplug.api import AttentionMask
from axplug.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    config_class,
    find_configs,
    replace_config,
)
from axplug.kernels import blockwise_attention, describe_kernels, select_kernel
from axplug.layers.attention import AttentionKernelSlot, DotProductKernel, paged_attention

__all__ = ["FlashAttention", "BlockwiseAttention", "FlashAttentionModifier"]

log = logging.getLogger("axplug.kernels")


class FlashAttention(AttentionKernelSlot):
    """Attention kernel slot that dispatches to the best registered kernel for the backend."""

    @config_class
    class Config(AttentionKernelSlot.Config):
        # Registry names to try in this order; None: every registered kernel by priority.
        kernels: list[str] | None = None
        # Backend the kernels are chosen for; None: jax.default_backend().
        backend: str | None = None

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.kernels is not None:
            known = registry.names("kernels")
            for name in cfg.kernels:
                if name not in known:
                    raise ConfigError(
                        f"{self.path}.kernels: no kernel {name!r} is registered; "
                        f"registered kernels: {', '.join(known) or 'none'}"
                    )

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        cfg = self._config
        name, kernel = select_kernel(q, k, v, mask, backend=cfg.backend, names=cfg.kernels)
        log.debug("%s: attention kernel %s", self.path, name)
        scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return kernel(q, k, v, mask, scale=scale)

    def paged_attention(self, q, paged, *, logit_softcap: float | None = None) -> jax.Array:
        """A decode step's q [b, h, d] over a paged cache's pages in place (`PagedKV`)."""
        cfg = self._config
        return paged_attention(
            q, paged, scale=cfg.scale, backend=cfg.backend, logit_softcap=logit_softcap
        )

    @classmethod
    def info_lines(cls) -> list[str]:
        """Extra lines for `axplug info`: the kernel chosen on this machine."""
        return describe_kernels()


class BlockwiseAttention(AttentionKernelSlot):
    """Attention kernel slot running `blockwise_attention` (O(seq) memory) at any length.

    `axplug aot` plans a GPU/TPU/Trainium rule on CPU with it: its memory is a flash kernel's.
    """

    @config_class
    class Config(AttentionKernelSlot.Config):
        block: int = 512  # keys per block

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        cfg = self._config
        scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return blockwise_attention(q, k, v, mask, scale=scale, block=cfg.block)


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

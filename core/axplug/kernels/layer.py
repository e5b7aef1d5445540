"""Attention kernel slots: `FlashAttention` runs the best registered kernel,
`BlockwiseAttention` always the memory-efficient blockwise one."""

from __future__ import annotations

import logging
import math

import jax

from axplug import registry
from axplug.config import ConfigError, config_class
from axplug.kernels.blockwise import blockwise_attention
from axplug.kernels.dispatch import describe_kernels, select_kernel
from axplug.layers import AttentionMask, BaseLayer
from axplug.layers.attention import paged_attention

__all__ = ["FlashAttention", "BlockwiseAttention"]

log = logging.getLogger("axplug.kernels")


class FlashAttention(BaseLayer):
    """Attention kernel slot that dispatches to the best registered kernel for the backend."""

    @config_class
    class Config(BaseLayer.Config):
        scale: float | None = None  # None: 1/sqrt(head_dim)
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

    def paged_attention(self, q, paged) -> jax.Array:
        """A decode step's q [b, h, d] over a paged cache's pages in place (`PagedKV`)."""
        return paged_attention(q, paged, scale=self._config.scale, backend=self._config.backend)

    @classmethod
    def info_lines(cls) -> list[str]:
        """Extra lines for `axplug info`: the kernel chosen on this machine."""
        return describe_kernels()


class BlockwiseAttention(BaseLayer):
    """Attention kernel slot running `blockwise_attention` (O(seq) memory) at any length.

    `axplug aot` plans a GPU/TPU/Trainium rule on CPU with it: its memory is a flash kernel's.
    """

    @config_class
    class Config(BaseLayer.Config):
        scale: float | None = None  # None: 1/sqrt(head_dim)
        block: int = 512  # keys per block

    def forward(self, q, k, v, mask: AttentionMask) -> jax.Array:
        cfg = self._config
        scale = cfg.scale if cfg.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return blockwise_attention(q, k, v, mask, scale=scale, block=cfg.block)

    def paged_attention(self, q, paged) -> jax.Array:
        """A decode step's q [b, h, d] over a paged cache's pages in place (`PagedKV`)."""
        return paged_attention(q, paged, scale=self._config.scale)

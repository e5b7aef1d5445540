"""The `batch_invariant` modifier: every projection, tied head and attention kernel of a model
computes each token in one order, whatever shares its step."""

from __future__ import annotations

from typing import Any

from axplug.api.config import (
    ConfigBase,
    ConfigError,
    ConfigModifier,
    replace_config,
    visit,
)
from axplug.api.layers import (
    AttentionKernelSlot,
    DotProductKernel,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
)
from axplug_batch_invariant.layers import (
    BatchInvariantEmbedding,
    BatchInvariantFeedForward,
    BatchInvariantKernel,
    BatchInvariantLayerNorm,
    BatchInvariantLinear,
    BatchInvariantRMSNorm,
)

__all__ = ["BatchInvariantModifier"]

_SWAPS = (
    (Linear, BatchInvariantLinear),
    (Embedding, BatchInvariantEmbedding),
    (RMSNorm, BatchInvariantRMSNorm),
    (LayerNorm, BatchInvariantLayerNorm),
    (FeedForward, BatchInvariantFeedForward),
)


class BatchInvariantModifier(ConfigModifier):
    """`--modifier batch_invariant`: a token's logits and log-probabilities are the same bits
    whether it is decoded alone or batched, prefilled whole, in chunks or after a cached
    prefix. Every projection, norm, feed-forward block and attention kernel is swapped for
    its batch-invariant twin. Slower: a serving and evaluation mode for reproducible scores,
    not for training."""

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        for old, new in _SWAPS:
            cfg = replace_config(cfg, target=old, new_cfg=new.default_config(), missing_ok=True)
        kernel = BatchInvariantKernel.default_config()
        cfg = replace_config(cfg, target=DotProductKernel, new_cfg=kernel, missing_ok=True)
        others = [k.klass.__qualname__ for k in _kernel_slots(cfg)
                  if k.klass is not BatchInvariantKernel]  # fmt: skip
        if others:
            raise ConfigError(
                f"modifier batch_invariant: attention kernel {others[0]} is not "
                "batch-invariant; drop the modifier that set it"
            )
        return cfg


def _kernel_slots(cfg: ConfigBase) -> list[Any]:
    """Every attention kernel slot config in `cfg`."""
    found: list[Any] = []

    def note(_path, value):
        klass = getattr(value, "klass", None)
        if isinstance(klass, type) and issubclass(klass, AttentionKernelSlot):
            found.append(value)

    visit(cfg, note)
    return found

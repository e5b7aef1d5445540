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
    (DotProductKernel, BatchInvariantKernel),
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
        if left := _not_invariant(cfg):
            path, klass = left[0]
            raise ConfigError(
                f"modifier batch_invariant: {path} ({klass}) has no batch-invariant form (another "
                "kernel, a subclass of a swapped layer, an adapter, an MoE block); drop what set "
                "it, or run without batch_invariant"
            )
        return cfg


def _not_invariant(cfg: ConfigBase) -> list[tuple[str, str]]:
    """(path, class name) of every layer the swaps left as it was: another attention kernel,
    a subclass of a swapped layer (quantized), a projection's adapter, a feed-forward block
    of another kind (MoE)."""
    twins = {new for _, new in _SWAPS}
    bases = tuple(old for old, _ in _SWAPS) + (AttentionKernelSlot,)  # any kernel slot
    found: list[tuple[str, str]] = []

    def note(path: str, value: Any) -> None:
        klass = getattr(value, "klass", None)
        if not isinstance(klass, type):
            return
        if klass in twins:
            if (adapter := getattr(value, "adapter", None)) is not None:
                found.append((f"{path}.adapter", adapter.klass.__name__))
        elif issubclass(klass, bases) or path.rsplit(".", 1)[-1] == "feed_forward":
            found.append((path, klass.__name__))

    visit(cfg, note)
    return found

"""Context parallelism: attention over a sequence split across the `seq` mesh axis by ring
(load-balanced for causal masks), all-to-all (Ulysses) or all-gather."""

from axplug_context_parallel.layer import (
    STRATEGIES,
    ContextParallelAttention,
    ContextParallelModifier,
)
from axplug_context_parallel.layout import from_zigzag, to_zigzag
from axplug_context_parallel.ring import Skip, ring_attention, ring_work

__all__ = [
    "STRATEGIES",
    "ContextParallelAttention",
    "ContextParallelModifier",
    "Skip",
    "from_zigzag",
    "ring_attention",
    "ring_work",
    "to_zigzag",
]

"""axplug-moe: mixture-of-experts feed-forward with expert parallelism.

Importing this package registers nothing by side effect: the core finds its components through
the entry points in pyproject.toml.
"""

from axplug_moe.alltoall import AllToAllDispatch
from axplug_moe.dispatch import (
    BalancedDispatch,
    Dispatch,
    EinsumDispatch,
    Experts,
    GatherDispatch,
    RaggedDispatch,
)
from axplug_moe.dispatchers import DISPATCHERS, AutoDispatch
from axplug_moe.group import DenseFirstStack, MoELayerGroup, RepeatedDenseFirstStack
from axplug_moe.layer import MoEFeedForward
from axplug_moe.modifiers import MoEModifier
from axplug_moe.router import (
    DeepSeekRouter,
    Routing,
    TopKRouter,
    expert_capacity,
    group_limited_top_k,
)

__version__ = "0.1.0"

__all__ = [
    "DISPATCHERS",
    "AllToAllDispatch",
    "AutoDispatch",
    "DeepSeekRouter",
    "DenseFirstStack",
    "RepeatedDenseFirstStack",
    "Dispatch",
    "EinsumDispatch",
    "Experts",
    "GatherDispatch",
    "MoEFeedForward",
    "MoELayerGroup",
    "MoEModifier",
    "RaggedDispatch",
    "Routing",
    "BalancedDispatch",
    "TopKRouter",
    "expert_capacity",
    "group_limited_top_k",
]

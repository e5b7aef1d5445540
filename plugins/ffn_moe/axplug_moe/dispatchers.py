"""`auto`, the dispatch chosen at trace time, and the `moe` modifier's names for them all."""

from __future__ import annotations

import jax

from axplug.api.sharding import mesh_axis_size
from axplug_moe.alltoall import AllToAllDispatch
from axplug_moe.dispatch import (
    BalancedDispatch,
    Dispatch,
    EinsumDispatch,
    GatherDispatch,
    RaggedDispatch,
)

__all__ = ["AutoDispatch", "DISPATCHERS"]


class AutoDispatch(Dispatch):
    """With a capacity (some choices can drop): `gather`. Drop-free: `alltoall` where the
    mesh splits the experts, else `ragged` on GPU/TPU and `balanced` elsewhere. Chosen at
    trace time (measured on CPU only)."""

    def __init__(self, cfg: Dispatch.Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        self._add_child("gather", GatherDispatch.default_config())
        self._add_child("ragged", RaggedDispatch.default_config())
        self._add_child("balanced", BalancedDispatch.default_config())
        self._add_child("alltoall", AllToAllDispatch.default_config())

    @staticmethod
    def choose(backend: str, capacity: int, group_size: int, expert_shards: int = 1) -> str:
        """The dispatch `auto` runs for this backend, (static) capacity and expert split."""
        if capacity < group_size:
            return "gather"
        if expert_shards > 1:
            return "alltoall"
        return "ragged" if backend in ("gpu", "tpu") else "balanced"

    def forward(self, x, routing, experts):
        shards = mesh_axis_size("expert")
        name = self.choose(jax.default_backend(), routing.capacity, x.shape[1], shards)
        return getattr(self, name)(x, routing, experts)


DISPATCHERS: dict[str, type[Dispatch]] = {
    "auto": AutoDispatch,
    "einsum": EinsumDispatch,
    "gather": GatherDispatch,
    "ragged": RaggedDispatch,
    "balanced": BalancedDispatch,
    "alltoall": AllToAllDispatch,
}

"""Per-process input: which rows of the global batch a process feeds, and assembling them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["process_rows", "shard_input_config", "put_process_batch"]


def process_rows(sharding: jax.sharding.Sharding, global_batch: int) -> tuple[int, int]:
    """`(start, stop)`: the rows of a [global_batch, ...] array on this process's devices.

    Raises ValueError when those rows are not one contiguous block, which a per-process input
    (rows `[i * b, (i + 1) * b)`) cannot feed.
    """
    indices = sharding.addressable_devices_indices_map((global_batch,))
    rows = set()
    for index in indices.values():
        rows.update(range(*index[0].indices(global_batch)))
    start, stop = min(rows), max(rows) + 1
    if len(rows) != stop - start:
        raise ValueError(
            f"process {jax.process_index()} holds rows {sorted(rows)} of the global batch, which "
            "are not contiguous; order the mesh devices by process (the default over "
            "jax.devices()) so each process feeds one block of rows"
        )
    return start, stop


def shard_input_config(cfg: Any, sharding: jax.sharding.Sharding) -> Any:
    """A copy of an input config set to produce this process's rows (unchanged on one process).

    Only inputs with `batch_size`, `process_index` and `process_count` fields (every
    `StepInput`) are split; other inputs must yield this process's rows themselves.
    """
    if jax.process_count() == 1 or not all(
        hasattr(cfg, f) for f in ("batch_size", "process_index", "process_count")
    ):
        return cfg
    start, stop = process_rows(sharding, cfg.batch_size)
    rows = stop - start
    return cfg.clone(process_index=start // rows, process_count=cfg.batch_size // rows)


def put_process_batch(batch: dict, sharding: jax.sharding.Sharding) -> dict:
    """Global arrays from this process's rows of each entry (a plain device_put on one process).

    The global shape is inferred from the sharding: each process holds an equal block of rows.
    """
    if jax.process_count() == 1:
        return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
    }

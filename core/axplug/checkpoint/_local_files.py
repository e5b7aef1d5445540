"""One process's files of a local-tier step: its shards in one data file, a JSON index.

A step directory holds `shards.bin` (the raw bytes of every distinct shard this process
holds, back to back), `index.json` (per leaf: name, global shape, dtype, and per shard its
devices, index, offset, size and CRC-32) and `commit`, written last. It is written under a
temporary name and renamed into place, so a directory named `step_XXXXXXXX` is always whole;
the marker also marks it for tools that copy directories. No pickle: the data is raw
row-major bytes, read back with `numpy.frombuffer`.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "FORMAT",
    "COMMIT",
    "INDEX",
    "DATA",
    "TEMP_SUFFIX",
    "write_step",
    "read_index",
    "read_shard",
]

FORMAT = 1
COMMIT = "commit"
INDEX = "index.json"
DATA = "shards.bin"
TEMP_SUFFIX = ".partial"


def write_step(final: str, header: dict, leaves: list[dict], data: list[np.ndarray]) -> None:
    """Writes `data` (host shards, in the order `leaves`' shards name them) and the index
    under `final`: into `final + TEMP_SUFFIX` first, the marker last, then renamed."""
    temp = final + TEMP_SUFFIX
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(temp)
    offset, shards = 0, iter(data)
    with open(os.path.join(temp, DATA), "wb") as out:
        for leaf in leaves:
            for shard in leaf["shards"]:
                buffer = memoryview(np.ascontiguousarray(next(shards))).cast("B")
                out.write(buffer)
                shard.update(offset=offset, nbytes=len(buffer), crc32=zlib.crc32(buffer))
                offset += len(buffer)
    index = {"format": FORMAT, **header, "leaves": leaves}
    with open(os.path.join(temp, INDEX), "w") as f:
        json.dump(index, f)
    with open(os.path.join(temp, COMMIT), "w") as f:
        f.write("complete\n")
    if os.path.exists(final):  # a step of a history the restore discarded, saved again
        shutil.rmtree(final)
    os.rename(temp, final)


def read_index(step_dir: str) -> dict:
    """The index of a complete step directory (ValueError/OSError when unreadable)."""
    with open(os.path.join(step_dir, INDEX)) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"index format {index.get('format')!r}, this version reads {FORMAT}")
    return index


def read_shard(data: Any, leaf: dict, shard: dict) -> np.ndarray:
    """One shard of `leaf` from the step's data file contents `data` (bytes or mmap);
    ValueError when its bytes fail their CRC-32."""
    start, size = shard["offset"], shard["nbytes"]
    buffer = data[start : start + size]
    if len(buffer) != size or zlib.crc32(buffer) != shard["crc32"]:
        raise ValueError(f"{leaf['name']}: shard at byte {start} fails its CRC-32")
    shape = [stop - begin for begin, stop in shard["index"]]
    return np.frombuffer(buffer, dtype=jnp.dtype(leaf["dtype"])).reshape(shape)

"""`LocalTier`: fast per-process checkpoints on a host's RAM disk or local SSD, every few steps.

Each process writes only the shards its devices hold, under `directory/process_<i>/`, so the
directory is per host and never shared. A save copies the shards to host memory and writes
them in a background thread (`async_save`); the next save waits for the previous write. A
step is listed only once it is complete (`_local_files`). A step restores only onto the
same layout: the same process count and, per leaf, the same shard on every device.
Which step a run restores, and from which tier, is `axplug.trainer.local_restore`'s choice.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from axplug.checkpoint import _local_files as files
from axplug.checkpoint._tree import first_non_finite
from axplug.checkpoint.checksum import leaf_names
from axplug.checkpoint.integrity import first_line
from axplug.checkpoint.layout import parse_step, step_dir_name, steps_to_keep
from axplug.config import Configurable, config_class

__all__ = ["LocalTier"]

log = logging.getLogger("axplug.checkpoint")


def _device_index(index: tuple, shape: tuple) -> list[list[int]]:
    """`[[start, stop], ...]` of a shard's index (a tuple of slices) into `shape`."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _layout(leaf: Any, shape: tuple) -> dict[str, list[list[int]]]:
    """{device id: index} of this process's devices for a leaf with `leaf.sharding`."""
    pieces = leaf.sharding.addressable_devices_indices_map(shape)
    return {str(d.id): _device_index(i, shape) for d, i in pieces.items()}


def _topology(tree: Any) -> dict:
    """Process and device counts and mesh axes: what a log line says of a layout."""
    sharding = jax.tree.leaves(tree)[0].sharding
    mesh = getattr(sharding, "mesh", None)
    axes = {str(k): int(v) for k, v in mesh.shape.items() if v > 1} if mesh is not None else {}
    return {
        "process_count": jax.process_count(),
        "device_count": len(sharding.device_set),
        "mesh": axes,
    }


def _describe(topology: dict) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in topology.get("mesh", {}).items()) or "none"
    return (
        f"{topology.get('process_count')} process(es), {topology.get('device_count')} "
        f"devices, mesh {mesh}"
    )


class LocalTier(Configurable):
    """Saves this process's shards of a training state every `every` steps under
    `directory/process_<i>`, keeping the last `keep_last`; off while `directory` is None."""

    @config_class
    class Config(Configurable.Config):
        # A per-host path (RAM disk such as /dev/shm/NAME, or a local SSD); None: no local
        # tier. Never a shared file system: each process writes its own process_<i> in it.
        directory: str | None = None
        every: int = 10  # steps between local saves (the persistent tier: checkpoint_every)
        keep_last: int = 2
        async_save: bool = True  # write in a background thread once off the devices

    def __init__(self, cfg: LocalTier.Config):
        super().__init__(cfg)
        cfg = self._config
        if cfg.directory is not None and (not isinstance(cfg.directory, str) or not cfg.directory):
            raise cfg.field_error(
                "directory", f"must be a local path or None, got {cfg.directory!r}"
            )
        if cfg.directory is not None and "://" in cfg.directory:
            raise cfg.field_error(
                "directory",
                f"must be a path on this host (a RAM disk or local SSD), got {cfg.directory!r}; "
                "URLs belong in checkpointer.directory, the persistent tier",
            )
        existing = os.path.expanduser(cfg.directory or "")
        while existing and not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if existing and not os.path.isdir(existing):
            raise cfg.field_error(
                "directory", f"{existing} is a file, not a directory; give a directory on this host"
            )
        for name in ("every", "keep_last"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise cfg.field_error(name, f"must be an int of at least 1, got {value!r}")
        self.every: int = cfg.every
        self.run_id: str | None = None  # recorded with each save; set by the restore
        self.directory = os.path.join(
            os.path.expanduser(cfg.directory or ""), f"process_{jax.process_index()}"
        )
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="axplug-local-ckpt")
        self._pending: tuple[int, Future] | None = None

    # -- listing -----------------------------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, step_dir_name(step))

    def complete_steps(self) -> list[int]:
        """This process's complete steps, ascending ([] when the directory is gone)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        steps = [parse_step(n) for n in names]
        return sorted(
            s
            for s in steps
            if s is not None and os.path.exists(os.path.join(self.step_dir(s), files.COMMIT))
        )

    def unusable(self, step: int, target: Any, run_id: str | None) -> str | None:
        """Why `step` cannot restore onto `target` here (another run, layout or tree, an
        unreadable index), or None when it can."""
        try:
            index = files.read_index(self.step_dir(step))
        except (OSError, ValueError) as exc:
            return f"its index cannot be read ({first_line(exc)})"
        if run_id is not None and index.get("run_id") != run_id:
            return "it belongs to another run (the persistent directory was replaced)"
        now = _topology(target)
        saved = {k: index.get(k) for k in now}
        if saved != now or index.get("process_index") != jax.process_index():
            return f"it was saved on another layout ({_describe(saved)}; now {_describe(now)})"
        leaves = index["leaves"]
        wanted = jax.tree.leaves(target)
        if [leaf["name"] for leaf in leaves] != leaf_names(target):
            return "it holds another state tree (another model or optimizer)"
        for leaf, x in zip(leaves, wanted, strict=True):
            held = {str(d): s["index"] for s in leaf["shards"] for d in s["devices"]}
            shape = tuple(x.shape)
            if leaf["shape"] != list(shape) or leaf["dtype"] != str(x.dtype):
                saved = f"{leaf['dtype']}{leaf['shape']}"
                return f"{leaf['name']} is {saved}, here {x.dtype}{list(shape)}"
            if held != _layout(x, shape):
                return f"{leaf['name']} is sharded differently (saved on another mesh or rules)"
        return None

    # -- saving ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `step` is a local save step."""
        return step % self.every == 0

    def save(self, step: int, state: Any) -> bool:
        """Copies this process's shards of `state` off the devices and writes them as `step`
        (in the background with `async_save`). A failure (a full disk, a non-finite state) is
        logged, never raised: the persistent tier is the one a run depends on. Returns whether
        the save started."""
        self.wait_until_finished()  # a failed previous write is logged; this one goes ahead
        bad = first_non_finite(state)
        if bad is not None:
            log.warning("local tier: not saving step %d: state leaf %s is non-finite", step, bad)
            return False
        names, leaves = leaf_names(state), jax.tree.leaves(state)
        index, pieces = [], []
        for name, x in zip(names, leaves, strict=True):
            shape = tuple(x.shape)
            distinct: dict[str, dict] = {}  # one copy of each distinct shard on this process
            for shard in x.addressable_shards:
                where = _device_index(shard.index, shape)
                key = repr(where)
                if key not in distinct:
                    distinct[key] = {"index": where, "devices": []}
                    pieces.append(shard.data)
                distinct[key]["devices"].append(shard.device.id)
            index.append(
                {
                    "name": name,
                    "shape": list(shape),
                    "dtype": str(x.dtype),
                    "shards": list(distinct.values()),
                }  # fmt: skip
            )
        # The state is donated to the next step: own the host copies before it runs.
        data = [a if a.flags.owndata else a.copy() for a in map(np.asarray, jax.device_get(pieces))]
        header = {
            "step": step,
            "run_id": self.run_id,
            "process_index": jax.process_index(),
            **_topology(state),
        }
        future = self._writer.submit(self._write, step, header, index, data)
        self._pending = (step, future)
        if not self._config.async_save:
            return self.wait_until_finished()
        return True

    def _write(self, step: int, header: dict, index: list, data: list) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # leftovers of a killed save
            if name.endswith(files.TEMP_SUFFIX):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        files.write_step(self.step_dir(step), header, index, data)
        keep = steps_to_keep(self.complete_steps(), self._config.keep_last, None)
        for old in self.complete_steps():
            if old not in keep:
                self.delete(old)

    def wait_until_finished(self) -> bool:
        """Blocks until the background write (if any) is done; False (logged) if it failed."""
        if self._pending is None:
            return True
        (step, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as exc:
            log.warning(
                "local tier: saving step %d to %s failed (%s); training continues",
                step, self.directory, first_line(exc),
            )  # fmt: skip
            shutil.rmtree(self.step_dir(step) + files.TEMP_SUFFIX, ignore_errors=True)
            return False
        return True

    def delete(self, step: int) -> None:
        """Removes `step`, its marker first (a half-deleted step is never listed)."""
        path = self.step_dir(step)
        marker = os.path.join(path, files.COMMIT)
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(path, ignore_errors=True)

    # -- restoring ---------------------------------------------------------------------------

    def restore(self, step: int, target: Any) -> Any:
        """`step` as global arrays laid out like `target` (ShapeDtypeStructs with shardings),
        from this process's shards; every process calls it. ValueError/OSError when the files
        are unreadable or fail their CRC-32 (check `unusable` first for the layout)."""
        path = self.step_dir(step)
        index = files.read_index(path)
        with open(os.path.join(path, files.DATA), "rb") as f:
            data = memoryview(f.read())
        leaves, treedef = jax.tree.flatten(target)
        arrays = []
        for leaf, x in zip(index["leaves"], leaves, strict=True):
            host = {}
            for shard in leaf["shards"]:
                piece = files.read_shard(data, leaf, shard)
                for device in shard["devices"]:
                    host[device] = piece
            devices = x.sharding.addressable_devices_indices_map(tuple(x.shape))
            parts = [jax.device_put(host[d.id], d) for d in devices]
            arrays.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts))
        return jax.tree.unflatten(treedef, arrays)

    def close(self) -> None:
        """Waits for the pending write, then stops the writer thread; idempotent."""
        self.wait_until_finished()
        self._writer.shutdown(wait=True)

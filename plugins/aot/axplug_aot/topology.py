"""Compile-only devices for `axplug aot`: a real TPU topology through libtpu where installed.

`jax.experimental.topologies` builds abstract devices of a TPU slice from libtpu's compile-only
client, with no TPU attached: a step compiled on them is the TPU compiler's program, memory
and all. Without libtpu, and for GPU or Trainium targets (JAX has no compile-only client for
them), `axplug aot` compiles on fake CPU devices instead and says so.
"""

from __future__ import annotations

import importlib.util
import re

__all__ = ["tpu_topology_name", "compile_only_devices", "libtpu_available"]

# Chips per slice -> the slice's chip grid: v5e/v6e slices are 2D tori, v4/v5p 3D. A selector
# counts JAX devices, one per chip (as `axplug.mesh_rules.selector_device_count` and the mesh rules
# do), not Cloud TPU's TensorCore-counting slice names (there v5p-8 is 4 chips).
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
            256: "16x16"}  # fmt: skip
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16",
            4096: "16x16x16"}  # fmt: skip
_GENERATIONS = {"v5e": _GRID_2D, "v6e": _GRID_2D, "v4": _GRID_3D, "v5p": _GRID_3D}
_ALIASES = {"v5-lite": "v5e", "v5litepod": "v5e", "v6-lite": "v6e", "v5": "v5p"}


def tpu_topology_name(selector: str) -> tuple[str, int] | None:
    """(`jax.experimental.topologies` name, slices) of a TPU selector, e.g. `tpu-v5e-256x2` ->
    ("v5e:16x16", 2); None when `selector` names no TPU slice this table knows."""
    match = re.fullmatch(r"tpu-(?:tpu-)?([a-z0-9-]+?)-(\d+)(?:x(\d+))?", selector.lower())
    if not match:
        return None
    generation = _ALIASES.get(match.group(1), match.group(1))
    if generation not in _GENERATIONS:
        return None
    grid = _GENERATIONS[generation].get(int(match.group(2)))
    if grid is None:
        return None
    return f"{generation}:{grid}", int(match.group(3) or 1)


def libtpu_available() -> bool:
    """Whether libtpu (the TPU compiler and its compile-only client) is importable."""
    spec = importlib.util.find_spec("libtpu")
    return spec is not None and spec.origin is not None  # not a stray `libtpu/` directory


def compile_only_devices(platform: str, selector: str, num_devices: int):
    """(devices, description) to compile a `num_devices` step for, or (None, why not)."""
    if platform != "tpu":
        return None, f"JAX has no compile-only {platform} client"
    named = tpu_topology_name(selector)
    if named is None:
        return None, f"no TPU topology is known for selector {selector!r}"
    if not libtpu_available():
        return None, "libtpu is not installed (pip install libtpu for a TPU compile)"
    from jax.experimental import topologies

    name, slices = named
    try:
        devices = topologies.get_topology_desc(name, "tpu", num_slices=slices).devices
    except Exception as exc:  # noqa: BLE001 - an old libtpu, an unknown chip
        return None, f"libtpu could not describe {name} x{slices}: {type(exc).__name__}: {exc}"
    if len(devices) != num_devices:
        return None, f"topology {name} x{slices} has {len(devices)} devices, not {num_devices}"
    return list(devices), f"TPU topology {name} x{slices} (libtpu, compile-only)"

"""The tensors of a Hugging Face checkpoint directory (`*.safetensors`, sharded or not), read
lazily with `safetensors` into numpy, each checked against the shape the caller expects, for
a floating-point dtype and for NaN and inf.

One shard file is open at a time: safetensors memory-maps it, and every page read stays in
the process's resident memory until the file is closed, so keeping each shard open would
add the whole checkpoint to the import's peak memory."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from safetensors import safe_open

from axplug.interop.hf_config import HFImportError

__all__ = ["SafetensorsDir", "FLOAT_DTYPES", "count_non_finite"]

INDEX_FILE = "model.safetensors.index.json"
# The safetensors dtypes a weight may have. Integers and booleans would be cast to float:
# an int8-quantized checkpoint with the stock tensor names would import as garbage.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_BLOCK = 2**22  # elements checked for NaN/inf at a time: a bool copy of one block, not the tensor


def count_non_finite(value: np.ndarray) -> int:
    """How many elements of `value` are NaN or inf."""
    flat = value.reshape(-1)
    return sum(
        int(flat[i : i + _BLOCK].size - np.count_nonzero(np.isfinite(flat[i : i + _BLOCK])))
        for i in range(0, flat.size, _BLOCK)
    )


def _renamed(name: str, prefixes: Mapping[str, str]) -> str:
    """`name` with the first of `prefixes` it starts with replaced by that prefix's value."""
    old = next((p for p in prefixes if name.startswith(p)), None)
    return name if old is None else prefixes[old] + name[len(old) :]


class SafetensorsDir(contextlib.AbstractContextManager):
    """Tensor name -> file map of `directory`: the shards its index file lists, else
    model.safetensors, else every *.safetensors file. `get` reads one tensor and records it as
    used, so leftovers can be reported."""

    def __init__(self, directory: str, prefixes: Mapping[str, str] | None = None):
        self.directory = directory
        self._file: str | None = None  # the one open shard, and its handle
        self._handle: Any = None
        try:
            stored = self._index()
        except BaseException:
            self.close()
            raise
        # Names as `prefixes` rename them (an older layout's), and each one's stored name.
        self._stored = {_renamed(name, prefixes or {}): name for name in stored}
        self._where = {name: stored[old] for name, old in self._stored.items()}
        self._used: set[str] = set()

    def _index(self) -> dict[str, str]:
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFImportError(f"{index}: no 'weight_map' object")
            for file in sorted(set(weight_map.values())):
                if not os.path.exists(os.path.join(self.directory, file)):
                    raise HFImportError(f"{index} lists {file}, which is missing")
            return dict(weight_map)
        single = os.path.join(self.directory, "model.safetensors")
        # Some repositories also ship the original-format weights (consolidated.safetensors).
        files = [single] if os.path.exists(single) else []
        files = files or sorted(glob.glob(os.path.join(self.directory, "*.safetensors")))
        if not files:
            found = ", ".join(sorted(os.listdir(self.directory))) or "nothing"
            raise HFImportError(
                f"{self.directory}: no *.safetensors files (found: {found}); save the model "
                "with safe_serialization=True"
            )
        where: dict[str, str] = {}
        for path in files:
            file = os.path.basename(path)
            names = self._open(file).keys()  # a safe_open handle, not a dict
            for name in names:
                if name in where:
                    raise HFImportError(
                        f"{self.directory}: tensor {name!r} is in both {where[name]} and {file}"
                    )
                where[name] = file
        return where

    def _open(self, file: str) -> Any:
        """The handle of `file`, the shard open before it closed."""
        if file != self._file:
            self.close()
            path = os.path.join(self.directory, file)
            try:
                handle = safe_open(path, framework="np")
                handle.__enter__()
            except Exception as exc:
                raise HFImportError(f"{path}: not a readable safetensors file ({exc})") from None
            self._file, self._handle = file, handle
        return self._handle

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
        """Tensor `name` as numpy; missing or of another shape than `shape` (when given)
        fails naming it."""
        if name not in self._where:
            want = f" (expected shape {list(shape)})" if shape is not None else ""
            raise HFImportError(
                f"{self.directory}: tensor {name!r}{want} is missing "
                f"from the checkpoint ({len(self._where)} tensors in "
                f"{', '.join(sorted(set(self._where.values())))})"
            )
        file = self._where[name]
        handle = self._open(file)
        where = f"{self.directory}/{file}"
        try:
            info = handle.get_slice(self._stored[name])
            found, dtype = tuple(info.get_shape()), info.get_dtype()
        except Exception as exc:  # the index names a tensor its file lacks
            raise HFImportError(f"{where}: cannot read {name!r} ({exc})") from None
        if dtype not in FLOAT_DTYPES:
            raise HFImportError(
                f"{where}: tensor {name!r} has dtype {dtype}; only floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}) import: a quantized checkpoint must be "
                "dequantized to float16, bfloat16 or float32 first"
            )
        if shape is not None and found != tuple(int(d) for d in shape):
            raise HFImportError(
                f"{where}: tensor {name!r} has shape {list(found)}, but "
                f"config.json implies {list(shape)}; the weights and config.json disagree"
            )
        self._used.add(name)
        value = handle.get_tensor(self._stored[name])
        bad = count_non_finite(value)
        if bad:
            raise HFImportError(
                f"{where}: tensor {name!r} has {bad} NaN or inf value(s) of {value.size}; the "
                "checkpoint is damaged (download it again) or was saved from a diverged run"
            )
        return value

    def unused(self) -> list[str]:
        """Names never read by `get`."""
        return sorted(set(self._where) - self._used)

    def close(self) -> None:
        handle, self._file, self._handle = self._handle, None, None
        if handle is not None:
            handle.__exit__(None, None, None)

    def __exit__(self, *exc_info) -> None:
        self.close()

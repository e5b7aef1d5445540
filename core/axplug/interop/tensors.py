"""Hugging Face tensors <-> the parameter tree, by an architecture's `HFTensor` rules.

Import reads one checkpoint tensor at a time (memory-mapped by safetensors) straight into
preallocated arrays of the model's dtypes; a scanned stack's layers are written into their
slice of the stacked array, so peak host memory is the parameters plus one tensor. Export
yields one Hugging Face tensor at a time, for the writer to stream into shards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from axplug.api._hf import HFTensor
from axplug.interop.hf_config import HFImportError
from axplug.interop.safetensors_dir import count_non_finite

__all__ = ["hf_params", "hf_tensors", "flatten", "unflatten", "IGNORED_SUFFIXES"]

# Tensors some checkpoints carry that are buffers, not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

_LAYER = re.compile(r"^(decoder\.transformer)\.layer(\d+)\.(.*)$")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a.b": x}."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def unflatten(flat: Mapping[str, Any]) -> dict:
    """The inverse of `flatten`."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _scanned_path(path: str) -> tuple[str, int] | None:
    """`decoder.transformer.layer3.x` -> (`decoder.transformer.layer.x`, 3)."""
    m = _LAYER.match(path)
    return (f"{m.group(1)}.layer.{m.group(3)}", int(m.group(2))) if m else None


def _read(tensors: Any, rule: HFTensor) -> np.ndarray:
    parts = []
    for name in rule.names():
        a = tensors.get(name)
        if rule.part is not None:
            axis, start, stop = rule.part
            if a.ndim <= axis or a.shape[axis] < stop:
                raise HFImportError(
                    f"{tensors.directory}: tensor {name!r} has shape {list(a.shape)}; "
                    f"config.json implies rows {start}:{stop} along axis {axis}"
                )
            a = a[(slice(None),) * axis + (slice(start, stop),)]
        parts.append(a.T if rule.transpose else a)
    return np.stack(parts) if rule.experts is not None else parts[0]


def hf_params(tensors: Any, rules: Mapping[str, HFTensor], specs: dict) -> dict:
    """Numpy parameters with exactly the structure, shapes and dtypes of `specs` (the model's
    `create_parameter_specs_recursively()`, unrolled or scanned), read by `rules`."""
    want = flatten(specs)
    targets: dict[str, tuple[str, int | None]] = {}
    for path in rules:
        scanned = _scanned_path(path)
        if path in want:
            targets[path] = (path, None)
        elif scanned is not None and scanned[0] in want:
            targets[path] = scanned
        else:
            targets[path] = (path, None)  # reported below as a tensor without a place
    covered = {t for t, _ in targets.values()}
    missing = sorted(set(want) - covered)
    if missing:
        raise HFImportError(
            f"the axplug model has parameter(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} with no Hugging Face tensor; a modifier or "
            "override changed the model's structure"
        )
    extra = sorted(p for p, (t, _) in targets.items() if t not in want)
    if extra:
        raise HFImportError(
            f"Hugging Face tensors map to {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
            ", which the axplug model does not have; a modifier or override changed the "
            "model's structure"
        )
    out = {path: np.empty(spec.shape, spec.dtype) for path, spec in want.items()}
    for path, rule in rules.items():
        target, layer = targets[path]
        value = _read(tensors, rule)
        expected = want[target].shape[1:] if layer is not None else want[target].shape
        if tuple(value.shape) != tuple(expected):
            raise HFImportError(
                f"{path}: the axplug model expects shape {list(expected)}, the Hugging Face "
                f"tensor {rule.name!r} gives {list(value.shape)}; an override changed a "
                "dimension, or the weights and config.json disagree"
            )
        dest = out[target] if layer is None else out[target][layer]
        with np.errstate(over="ignore"):  # reported below, naming the tensor
            dest[...] = value
        if count_non_finite(dest):  # finite in the file, beyond the range of the model's dtype
            raise HFImportError(
                f"{path}: the Hugging Face tensor {rule.name!r} has values beyond the range of "
                f"{dest.dtype}, the parameter's dtype (inf once cast); store the parameters "
                "wider (--set model.dtype=float32) or fix the checkpoint"
            )
    return unflatten(out)


def _unrolled(params: dict) -> dict[str, np.ndarray]:
    """Flat `layerN` paths of an unrolled or a scanned parameter tree."""
    flat = {}
    for path, value in flatten(params).items():
        if path.startswith("decoder.transformer.layer."):
            rest = path[len("decoder.transformer.layer.") :]
            for i, a in enumerate(np.asarray(value)):
                flat[f"decoder.transformer.layer{i}.{rest}"] = a
        else:
            flat[path] = np.asarray(value)
    return flat


def hf_tensors(params: dict, rules: Mapping[str, HFTensor]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array) of every checkpoint tensor, in name order; each parameter
    without a rule is an error (the architecture cannot express it)."""
    flat = _unrolled(params)
    missing = sorted(set(flat) - set(rules))
    if missing:
        raise HFImportError(
            f"parameter(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} of the "
            "run have no place in the Hugging Face checkpoint"
        )
    pieces: dict[str, list[tuple[HFTensor, np.ndarray]]] = {}
    for path, rule in rules.items():
        value = flat[path]
        for e, name in enumerate(rule.names()):
            part = value[e] if rule.experts is not None else value
            pieces.setdefault(name, []).append((rule, part.T if rule.transpose else part))
    for name in sorted(pieces):
        group = pieces[name]
        if len(group) == 1 and group[0][0].part is None:
            yield name, np.ascontiguousarray(group[0][1])
            continue
        axis = group[0][0].part[0]  # type: ignore[index]
        group.sort(key=lambda p: p[0].part[1])  # type: ignore[index]
        yield name, np.ascontiguousarray(np.concatenate([a for _, a in group], axis=axis))

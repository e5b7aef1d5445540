"""Checkpoints that leave out frozen parameters: a fine-tune whose base never changes (LoRA
adapters over a `learner.trainable` selection) stores only what it trains, and its metadata
names where the rest comes from (`"frozen": {"from": checkpoint directory, "step": N,
"digest": the base step's parameter checksums, hashed}`).

`restore_params` reads a step's parameters whole, following that link (through as many
fine-tunes of fine-tunes as there are), and refuses a base whose parameters are not those the
fine-tune began from (a base re-imported or retrained in place) unless ALLOW_CHANGED_BASE_ENV=1.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from axplug.checkpoint.errors import CheckpointError

__all__ = [
    "FROZEN_KEY",
    "ALLOW_CHANGED_BASE_ENV",
    "params_digest",
    "prune",
    "split_saved",
    "joined",
    "restore_params",
]

FROZEN_KEY = "frozen"
ALLOW_CHANGED_BASE_ENV = "AXPLUG_ALLOW_CHANGED_BASE"
_MAX_DEPTH = 16


def params_digest(checkpointer: Any, step: int) -> str | None:
    """sha256 of the checksums of `step`'s parameters (None: a step saved without them)."""
    sums = checkpointer.saved_checksums(step)
    if sums is None:
        return None
    params = sorted((k, v) for k, v in sums.items() if k.startswith("params"))
    return hashlib.sha256(json.dumps(params).encode()).hexdigest()


def prune(keep: Any, tree: dict) -> dict:
    """`tree` without the leaves `keep` (a tree of bools of the same shape) marks False."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            kept = prune(keep[key], value)
            if kept:
                out[key] = kept
        elif keep[key]:
            out[key] = value
    return out


def split_saved(target: Any, saved: Any) -> tuple[dict, dict]:
    """(the part of the `target` tree that `saved` holds, the rest), by dict keys."""
    if not isinstance(target, dict):
        return target, {}
    present, missing = {}, {}
    for key, value in target.items():
        if not isinstance(saved, dict) or key not in saved:
            missing[key] = value
            continue
        here, rest = split_saved(value, saved[key])
        if not isinstance(value, dict) or here:
            present[key] = here
        if rest:
            missing[key] = rest
    return present, missing


def joined(a: dict, b: dict) -> dict:
    """The union of two trees with disjoint leaves."""
    out = dict(a)
    for key, value in b.items():
        out[key] = joined(out[key], value) if key in out else value
    return out


def restore_params(checkpointer: Any, step: int, target: dict, _depth: int = 0) -> dict:
    """Every parameter of `target` (ShapeDtypeStructs with shardings) from `step` of the open
    `checkpointer`; those it leaves out (frozen) from the step its metadata names."""
    source = checkpointer.metadata(step).get(FROZEN_KEY)
    if source is None:
        _, state, _ = checkpointer.restore(step, target={"params": target}, partial=True)
        return state["params"]
    present, missing = split_saved(target, checkpointer.saved_tree(step).get("params"))
    params = {}
    if present:
        _, state, _ = checkpointer.restore(step, target={"params": present}, partial=True)
        params = state["params"]
    if not missing:
        return params
    return joined(params, _source_params(checkpointer, step, source, missing, _depth))


def _source_params(checkpointer: Any, step: int, source: dict, missing: dict, depth: int) -> dict:
    from axplug.checkpoint.checkpointer import Checkpointer

    where = f"step {step} of {checkpointer.directory} stores only its trained parameters"
    if depth >= _MAX_DEPTH:
        raise CheckpointError(f"{where}; its frozen parameters link through over {depth} runs")
    base_step, wanted = int(source["step"]), source.get("digest")
    try:
        cfg = Checkpointer.default_config().set(directory=source["from"])
        with cfg.instantiate() as base:
            now = params_digest(base, base_step) if wanted else None
            if now == wanted or os.environ.get(ALLOW_CHANGED_BASE_ENV) == "1":
                return restore_params(base, base_step, missing, depth + 1)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{where}; the frozen ones come from step {source.get('step')} of "
            f"{source.get('from')} (its metadata's {FROZEN_KEY!r}), which cannot be read: "
            f"{exc}. Put that run back where it was"
        ) from None
    raise CheckpointError(
        f"{where}; the frozen ones come from step {base_step} of {source['from']}, whose "
        f"parameters changed since this fine-tune began from them (checksums {wanted[:12]} "
        f"then, {str(now)[:12]} now): the trained ones would meet another base. Put the "
        f"original base back, or set {ALLOW_CHANGED_BASE_ENV}=1 to use this one"
    )

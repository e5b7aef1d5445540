"""axplug-eval: lm-evaluation-harness tasks on axplug checkpoints and servers (`axplug eval`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EngineLM", "EvalTasksModifier", "LmEvalEvaluator", "cut_at_stops"]

# Imported on first use: `axplug eval --help` and `axplug doctor` need no lm-eval import.
_HOMES = {
    "EngineLM": "axplug_eval.lm",
    "cut_at_stops": "axplug_eval.lm",
    "EvalTasksModifier": "axplug_eval.training",
    "LmEvalEvaluator": "axplug_eval.training",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'axplug_eval' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)

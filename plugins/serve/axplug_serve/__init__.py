"""axplug-serve: an OpenAI-compatible HTTP server for axplug models (`axplug serve`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DevicePutTransfer",
    "DisaggregatedEngine",
    "EngineWorker",
    "KVTransfer",
    "QueueFullError",
    "ServerMetrics",
    "ServerSettings",
    "create_app",
]

# Imported on first use: `axplug serve --help` and `axplug doctor` need no web stack.
_HOMES = {
    "DevicePutTransfer": "axplug_serve.disaggregated",
    "DisaggregatedEngine": "axplug_serve.disaggregated",
    "KVTransfer": "axplug_serve.disaggregated",
    "EngineWorker": "axplug_serve.worker",
    "QueueFullError": "axplug_serve.worker",
    "ServerMetrics": "axplug_serve.metrics",
    "ServerSettings": "axplug_serve.app",
    "create_app": "axplug_serve.app",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'axplug_serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)

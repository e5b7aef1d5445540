"""The chat template a run was trained with: the one its data directory recorded."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["trained_template"]


def trained_template(loaded: Any) -> str | None:
    """The `chat_template.jinja` of the data the run (or, failing that, the run it was tuned
    from) trained on, as `prepare-chat` / `prepare-preferences` recorded it in meta.json;
    None when there is none (or the data directory is not where the run saw it)."""
    for _run, metadata in getattr(loaded, "lineage", []):
        data = (metadata.get("config") or {}).get("input") or {}
        path = data.get("path") if isinstance(data, dict) else None
        if not isinstance(path, str) or "://" in path:
            continue
        try:
            with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
                recorded = json.load(f).get("chat_template")
        except (OSError, ValueError):
            continue
        if isinstance(recorded, dict) and isinstance(recorded.get("file"), str):
            template = os.path.join(path, os.path.basename(recorded["file"]))
            if os.path.isfile(template):
                return template
    return None

"""A Hugging Face checkpoint's `config.json`, and the installed architecture that reads it.

Reading and finding the architecture import no jax: a directory without config.json, an
unparsable file or an architecture no installed plugin registers is refused in well under a
second, naming what is missing.
"""

from __future__ import annotations

import json
import os

from axplug import registry
from axplug.api import HFArchitecture
from axplug.config import ConfigError

__all__ = [
    "HFImportError",
    "read_config_json",
    "architecture_name",
    "load_architecture",
    "registered_architectures",
]

KIND = "architectures"


class HFImportError(ConfigError):
    """A Hugging Face checkpoint that cannot be imported; the message names the field or tensor."""


def read_config_json(directory: str) -> tuple[dict, str]:
    """(the parsed `directory/config.json`, its path); what is not a checkpoint fails."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFImportError(f"{directory}: not a directory (expected a Hugging Face checkpoint)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise HFImportError(
            f"{path}: missing; a Hugging Face checkpoint directory holds config.json and "
            "*.safetensors"
        ) from None
    except json.JSONDecodeError as exc:
        raise HFImportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HFImportError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw, path


def registered_architectures() -> list[str]:
    """The installed architectures, from entry-point metadata (nothing is imported)."""
    return registry.names(KIND)


def architecture_name(raw: dict, source: str) -> str:
    """The architecture config.json names, which an installed plugin must register."""
    installed = registered_architectures()
    archs = raw.get("architectures")
    if not archs:
        model_type = raw.get("model_type")
        by_type = [a for a in installed if _model_type(a) == model_type] if model_type else []
        if len(by_type) == 1:
            return by_type[0]
        raise HFImportError(
            f"{source}: no 'architectures' field (and model_type={model_type!r} names no "
            f"single installed architecture); installed: {', '.join(installed) or 'none'}"
        )
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise HFImportError(f"{source}: architectures={archs!r} (expected one class name)")
    arch = archs[0]
    if arch not in installed:
        off = [c for c in registry.discover(KIND) if c.name == arch]
        hint = (
            f"{arch} is in {off[0].distribution}, which is {off[0].status}: {off[0].reason}"
            if off
            else f"no installed plugin registers {arch}; install the plugin that does "
            "(docs/model-families.md lists the first-party families) or write one"
        )
        raise HFImportError(
            f"{source}: architectures={archs!r} is not installed: {hint} "
            f"(installed: {', '.join(installed) or 'none'}; see `axplug list --kind {KIND}`)"
        )
    return arch


def _model_type(arch: str) -> str | None:
    return load_architecture(arch).model_type


def load_architecture(name: str) -> HFArchitecture:
    """The registered architecture `name` (its class built, or its instance), read through
    `HFArchitecture`'s defaults."""
    return registry.load_as(KIND, name, HFArchitecture)

"""Hugging Face tensor mappings of plugin layers (`axplug.hf_mappings` entry points): how a
plugin's feed-forward layer reads and writes its Hugging Face tensors, so the core's
`import-hf` / `export-hf` know no plugin's parameters."""

from __future__ import annotations

from typing import Any

from axplug.interop.hf_config import HFImportError

__all__ = ["mappings", "mapping_for_architecture", "mapping_for_layer"]


def mappings() -> list[Any]:
    """Every installed mapping (each entry loads a class or an instance)."""
    from axplug import registry

    out = []
    for name in registry.names("hf_mappings"):
        obj = registry.load("hf_mappings", name)
        out.append(obj() if isinstance(obj, type) else obj)
    return out


def mapping_for_architecture(architecture: str) -> Any:
    """The mapping for a Hugging Face architecture's feed-forward (e.g. MixtralForCausalLM)."""
    for mapping in mappings():
        if mapping.architecture == architecture:
            return mapping
    raise HFImportError(
        f"no installed plugin maps the tensors of a {architecture}'s feed-forward layers "
        "(axplug list --kind hf_mappings); for Mixtral: pip install axplug-moe"
    )


def mapping_for_layer(layer_class: str) -> Any | None:
    """The mapping for an axplug feed-forward layer class name, or None."""
    return next((m for m in mappings() if m.layer == layer_class), None)

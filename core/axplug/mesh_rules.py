"""Mesh rules: an accelerator selector pattern mapped to a chain of registered modifiers."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

from axplug.config import REQUIRED, ConfigError, Configurable, Required, chain, config_class

__all__ = ["MeshRule", "detect_selector", "select_mesh_rule", "cpu_rule"]


class MeshRule(Configurable):
    """Applies `modifiers` (specs such as `mesh:fsdp=-1`) when a selector matches `pattern`."""

    @config_class
    class Config(Configurable.Config):
        pattern: Required[str] = REQUIRED  # fnmatch pattern, e.g. "gpu-*h100*-8x*"
        modifiers: list[str] = []
        description: str = ""

    def matches(self, selector: str) -> bool:
        return fnmatch.fnmatchcase(selector.lower(), self._config.pattern.lower())

    def modifier(self):
        """One modifier chaining this rule's modifiers in order."""
        from axplug.modifiers import make_modifier

        return chain(*(make_modifier(spec) for spec in self._config.modifiers))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def detect_selector(devices: Sequence | None = None) -> str:
    """`<platform>-<device kind>-<count>` of local devices, e.g. `cpu-8`, `gpu-nvidia-h100-8`."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    platform = devices[0].platform
    kind = _slug(getattr(devices[0], "device_kind", "") or "")
    if platform == "cpu" or not kind:
        return f"{platform}-{len(devices)}"
    return f"{platform}-{kind}-{len(devices)}"


def select_mesh_rule(selector: str = "auto") -> tuple[str, MeshRule]:
    """The first installed rule (by name) whose pattern matches `selector` (`auto`: detected)."""
    from axplug import registry

    if selector == "auto":
        selector = detect_selector()
    rules = []
    for name in registry.names("mesh_rules"):
        rule = registry.load("mesh_rules", name)().instantiate()
        if rule.matches(selector):
            return name, rule
        rules.append(f"{name} ({rule._config.pattern})")
    raise ConfigError(
        f"no installed mesh rule matches {selector!r}; installed rules: "
        f"{', '.join(rules) or 'none'}. Hardware rules come from plugins such as axplug-gpu, "
        "axplug-tpu and axplug-trainium"
    )


def cpu_rule() -> MeshRule.Config:
    """Data parallel over every CPU device."""
    return MeshRule.default_config().set(
        pattern="cpu-*", modifiers=["mesh:data=-1"], description=cpu_rule.__doc__
    )

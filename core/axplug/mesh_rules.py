"""Mesh rules: an accelerator selector pattern mapped to a chain of registered modifiers.

Device specs travel with mesh rules: a hardware plugin's `axplug.mesh_rules` entry loads a
function returning a `MeshRule.Config`, and `axplug.api.with_device_spec(spec)` attaches
`device_spec` to that function. `device_spec_of(rule_name)` reads it back, so any plugin's rule
can be planned for without a new registry kind. The selector's trailing `-N` or `-NxM` is the
device count.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

from axplug.api import DeviceSpec, device_spec_of_rule
from axplug.config import REQUIRED, ConfigError, Configurable, Required, chain, config_class

__all__ = [
    "MeshRule",
    "detect_selector",
    "select_mesh_rule",
    "resolve_rule",
    "selector_device_count",
    "device_spec_of",
    "detected_device_spec",
    "cpu_rule",
]


class MeshRule(Configurable):
    """Applies `modifiers` (specs such as `mesh:fsdp=-1`) when a selector matches `pattern`."""

    @config_class
    class Config(Configurable.Config):
        # fnmatch pattern, e.g. "gpu-*h100*-8x*", or `re:` and a regular expression that must
        # match the whole selector, e.g. r"re:tpu-v5e-\d+" (one slice of any size, never `x4`).
        pattern: Required[str] = REQUIRED
        modifiers: list[str] = []
        description: str = ""

    def matches(self, selector: str) -> bool:
        """Whether `selector` matches `pattern` (case-insensitive)."""
        pattern = self._config.pattern
        if not pattern.startswith("re:"):
            return fnmatch.fnmatchcase(selector.lower(), pattern.lower())
        try:
            return re.fullmatch(pattern[3:], selector, re.IGNORECASE) is not None
        except re.error as exc:
            raise ConfigError(
                f"mesh rule pattern {pattern!r} is not a valid regular expression ({exc}); "
                "fix it, or drop the `re:` prefix for an fnmatch pattern"
            ) from None

    def modifier(self):
        """One modifier chaining this rule's modifiers in order."""
        from axplug.modifiers import make_modifier

        return chain(*(make_modifier(spec) for spec in self._config.modifiers))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _hosts(devices: Sequence) -> tuple[int, int]:
    """(devices per host, hosts): hosts are TPU slices, else processes; the largest host counts."""
    from axplug.mesh import device_groups

    groups = device_groups(devices)
    return max(len(g) for g in groups), len(groups)


def detect_selector(devices: Sequence | None = None) -> str:
    """`<platform>-<device kind>-<per host>[x<hosts>]` of `devices` (default: all of them).

    E.g. `cpu-8`, `gpu-nvidia-h100-80gb-hbm3-8` (one host), `gpu-nvidia-h100-80gb-hbm3-8x32`
    (32 hosts of 8), `tpu-tpu-v5-lite-256x4` (4 slices of 256: on TPU a host is a slice),
    `neuron-nc-v3d-64`. CPU gives the total count, `cpu-<devices>`.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    platform = devices[0].platform
    if platform == "cpu":
        return f"cpu-{len(devices)}"
    per_host, hosts = _hosts(devices)
    count = f"{per_host}x{hosts}" if hosts > 1 else f"{per_host}"
    kind = _slug(getattr(devices[0], "device_kind", "") or "")
    return f"{platform}-{kind}-{count}" if kind else f"{platform}-{count}"


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
        f"{', '.join(rules) or 'none'}. Hardware rules come from hardware plugins (the README "
        "lists the first-party ones)"
    )


def device_spec_of(rule_name: str) -> DeviceSpec | None:
    """The DeviceSpec attached to the registered mesh rule `rule_name`, if any."""
    from axplug import registry

    return device_spec_of_rule(registry.load("mesh_rules", rule_name))


def detected_device_spec(devices=None) -> DeviceSpec | None:
    """The DeviceSpec of the installed mesh rule that auto-selection picks for `devices`."""
    try:
        name, _ = select_mesh_rule(detect_selector(devices))
    except ConfigError:  # no rule for this accelerator
        return None
    return device_spec_of(name)


def selector_device_count(selector: str) -> int | None:
    """`gpu-h100-8x32` -> 256, `tpu-v5e-256` -> 256, `cpu-8` -> 8, `cpu` -> None."""
    match = re.search(r"-(\d+)(?:x(\d+))?$", selector)
    if not match:
        return None
    return int(match.group(1)) * int(match.group(2) or 1)


def resolve_rule(name_or_selector: str):
    """(rule name, MeshRule): a registered rule name is used as is, else a selector is matched."""
    from axplug import registry

    if name_or_selector in registry.names("mesh_rules"):
        return name_or_selector, registry.load("mesh_rules", name_or_selector)().instantiate()
    return select_mesh_rule(name_or_selector)


def cpu_rule() -> MeshRule.Config:
    """Data parallel over every CPU device."""
    return MeshRule.default_config().set(
        pattern="cpu-*", modifiers=["mesh:data=-1"], description=cpu_rule.__doc__
    )

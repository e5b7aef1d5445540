"""`MeshRuleConformance`: a mesh rule's selector matching and its modifiers on stock presets."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from axplug_testing._util import require

__all__ = ["MESH_RULE_CAPABILITIES", "MeshRuleConformance", "OTHER_SELECTORS"]

MESH_RULE_CAPABILITIES = (
    "device_spec",  # the rule function carries a DeviceSpec (`@with_device_spec`) for `axplug aot`
    "registered",  # `select_mesh_rule` picks `rule_name` for each of `selectors` among installed
)

# What `detect_selector()` gives on common machines; a rule must not claim the ones it is not for.
OTHER_SELECTORS = (
    "cpu-1",
    "cpu-8",
    "gpu-nvidia-h100-80gb-hbm3-8",
    "gpu-nvidia-a100-sxm4-80gb-8",
    "tpu-tpu-v5-lite-8",
    "tpu-v5p-512",
    "trn2-16",
)


class MeshRuleConformance:
    """Subclass as `TestMyRule(MeshRuleConformance)`; override `rule` and `selectors`.

    `rule` is the registered function (what the `axplug.mesh_rules` entry point names) that
    returns a `MeshRule` config; `selectors` are selectors it must match, e.g. `gpu-h100-8` or
    what `detect_selector()` gives on the target machine. Optional fixtures: `rule_name` (the
    entry-point name, needed for `registered`), `other_selectors` (it must match none of them),
    `presets` (its modifiers must apply cleanly to each; default the core's gpt-tiny, and a
    plugin adds presets its tests install).
    """

    capabilities: tuple[str, ...] = MESH_RULE_CAPABILITIES

    # -- fixtures an author overrides ------------------------------------------------------

    @pytest.fixture
    def rule(self):
        raise NotImplementedError(
            f"{type(self).__name__}: override the `rule` fixture to return your mesh-rule "
            "function (the one your axplug.mesh_rules entry point names)"
        )

    @pytest.fixture
    def selectors(self) -> Sequence[str]:
        raise NotImplementedError(
            f"{type(self).__name__}: override the `selectors` fixture with selectors your rule "
            "must match, e.g. ['gpu-h100-8', 'gpu-nvidia-h100-80gb-hbm3-8']"
        )

    @pytest.fixture
    def rule_name(self) -> str | None:
        return None

    @pytest.fixture
    def other_selectors(self, selectors) -> Sequence[str]:
        return [s for s in OTHER_SELECTORS if s not in set(selectors)]

    @pytest.fixture
    def presets(self) -> Sequence[str]:
        return ["gpt-tiny"]

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def instantiate(rule):
        """The MeshRule that the rule function's config builds."""
        from axplug.mesh_rules import MeshRule

        cfg = rule()
        assert isinstance(cfg, MeshRule.Config), (
            f"{getattr(rule, '__name__', rule)}() returned {type(cfg).__name__}; a mesh rule "
            "returns MeshRule.default_config().set(pattern=..., modifiers=[...])"
        )
        return cfg.instantiate()

    # -- the checks ------------------------------------------------------------------------

    def test_capabilities_are_known(self):
        unknown = set(self.capabilities) - set(MESH_RULE_CAPABILITIES)
        assert not unknown, (
            f"unknown capabilities {sorted(unknown)}; known: {MESH_RULE_CAPABILITIES}"
        )

    def test_config_round_trip(self, rule):
        from axplug.config import from_dict, to_dict

        cfg = rule()
        again = from_dict(to_dict(cfg), trusted=True)
        assert again.debug_string() == cfg.debug_string(), "to_dict/from_dict lost fields"
        assert cfg.description, "describe the rule: `axplug list` and `axplug aot` show it"

    def test_matches_its_selectors(self, rule, selectors):
        assert selectors, "give at least one selector the rule is for"
        mesh_rule = self.instantiate(rule)
        missed = [s for s in selectors if not mesh_rule.matches(s)]
        assert not missed, f"pattern {mesh_rule.config.pattern!r} does not match {missed}"

    def test_matches_no_other_selector(self, rule, other_selectors):
        mesh_rule = self.instantiate(rule)
        claimed = [s for s in other_selectors if mesh_rule.matches(s)]
        assert not claimed, (
            f"pattern {mesh_rule.config.pattern!r} also matches {claimed}; narrow it, or list "
            "them in `selectors` if the rule is meant for them"
        )

    def test_modifiers_are_registered(self, rule):
        from axplug.modifiers import make_modifier

        mesh_rule = self.instantiate(rule)
        for spec in mesh_rule.config.modifiers:
            try:
                make_modifier(spec)
            except Exception as exc:
                raise AssertionError(f"modifier spec {spec!r}: {exc}") from exc

    def test_mesh_fits_the_selector_device_count(self, rule, selectors, presets):
        from axplug.mesh_rules import selector_device_count
        from axplug.presets import preset_config

        mesh_rule = self.instantiate(rule)
        cfg = mesh_rule.modifier()(preset_config(presets[0], overrides=["output_dir='unused'"]))
        shape = tuple(cfg.mesh.mesh_shape)
        assert list(shape).count(-1) <= 1, f"mesh_shape {shape}: at most one axis may be -1"
        fixed = math.prod(n for n in shape if n != -1)
        for selector in selectors:
            count = selector_device_count(selector)
            if count is None:
                continue
            fits = count % fixed == 0 if -1 in shape else count == fixed
            assert fits, f"mesh_shape {shape} does not fit the {count} devices of {selector!r}"

    def test_modifiers_apply_cleanly_to_presets(self, rule, presets):
        from axplug.config import to_dict
        from axplug.presets import preset_config

        mesh_rule = self.instantiate(rule)
        for name in presets:
            cfg = preset_config(name, overrides=["output_dir='unused'"])
            before = cfg.debug_string()
            out = mesh_rule.modifier()(cfg)
            where = f"preset {name}"
            assert cfg.debug_string() == before, f"{where}: the rule's modifiers mutated the input"
            again = mesh_rule.modifier()(out)
            assert again.debug_string() == out.debug_string(), (
                f"{where}: applying the rule twice changes the config; modifiers must reapply "
                "as updates"
            )
            to_dict(out)  # still a plain, serializable config tree
            out.model.instantiate(parent=None)  # and it still builds

    def test_selected_among_installed_rules(self, rule_name, selectors):
        require(self, "registered", MESH_RULE_CAPABILITIES)
        from axplug import registry
        from axplug.config import ConfigError
        from axplug.mesh_rules import select_mesh_rule

        assert rule_name, "declare `rule_name` (the entry-point name) for `registered`"
        try:
            registry.entry("mesh_rules", rule_name)
        except LookupError as exc:
            raise AssertionError(
                f"mesh rule {rule_name!r} is not installed; `pip install -e .` the plugin "
                f"(entry point group axplug.mesh_rules): {exc}"
            ) from None
        for selector in selectors:
            try:
                chosen, _ = select_mesh_rule(selector)
            except ConfigError as exc:
                raise AssertionError(f"selector {selector!r}: {exc}") from None
            assert chosen == rule_name, (
                f"selector {selector!r} picks installed rule {chosen!r}, not {rule_name!r}: "
                "rules are tried by name in sorted order, the first match wins"
            )

    def test_device_spec(self, rule):
        require(self, "device_spec", MESH_RULE_CAPABILITIES)
        from axplug.api import DeviceSpec, device_spec_of_rule

        spec = device_spec_of_rule(rule)
        assert isinstance(spec, DeviceSpec), (
            "decorate the rule function with @axplug.api.with_device_spec(DeviceSpec(...)) or "
            "drop the `device_spec` capability"
        )
        assert spec.peak_bf16_flops > 0 and spec.hbm_bytes > 0 and spec.chips_per_host > 0, (
            f"DeviceSpec {spec.name!r}: peak FLOP/s, HBM bytes and chips per host must be > 0"
        )

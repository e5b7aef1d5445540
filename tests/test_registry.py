"""Registry: metadata discovery, lazy isolated loading, API window, conflicts, switches, hooks."""

import sys

import pluggy
import pytest

import axplug
import axplug.api
from axplug import registry
from axplug.config import resolve_class
from axplug.registry import (
    Component,
    ComponentConflictError,
    ComponentNotFoundError,
    ComponentUnavailableError,
    PluginLoadError,
)
from fake_plugins import LAYER, MODIFIER, STORAGE

DENSE = LAYER
EXPLODES = "raise RuntimeError('boom at import')\n"


def _mine(site_components, distribution):
    return [c for c in site_components if c.distribution == distribution]


def _one(kind, name, distribution):
    (found,) = [
        c for c in registry.discover(kind) if c.name == name and c.distribution == distribution
    ]
    return found


def test_discover_reads_fields_from_metadata_without_importing(plugin_site):
    plugin_site.add(
        "fake-a",
        {
            "axplug.layers": {"dense": "fake_a_mod:Dense"},
            "axplug.modifiers": {"wide": "fake_a_mod"},
        },
        version="2.3",
        modules={"fake_a_mod": DENSE},
    )
    assert _mine(registry.discover(), "fake-a") == [
        Component("fake-a", "2.3", "layers", "dense", "fake_a_mod:Dense", "ok", None),
        Component("fake-a", "2.3", "modifiers", "wide", "fake_a_mod", "ok", None),
    ]
    assert "fake_a_mod" not in sys.modules
    core = _one("layers", "linear", "axplug")
    assert (core.version, core.value) == (axplug.__version__, "axplug.layers.basic:Linear")
    assert {c.kind for c in registry.discover("modifiers")} == {"modifiers"}


def test_discovery_is_cached_until_reset(plugin_site):
    registry.discover()
    plugin_site.add("fake-late", {"axplug.layers": {"late": "fake_late_mod:Dense"}})
    assert "late" not in registry.names("layers")
    registry.reset()
    assert "late" in registry.names("layers")


def test_load_is_lazy_cached_and_accepts_a_qualified_name(plugin_site):
    plugin_site.add(
        "fake-a", {"axplug.layers": {"dense": "fake_a_mod:Dense"}}, modules={"fake_a_mod": DENSE}
    )
    assert "fake_a_mod" not in sys.modules
    dense = registry.load("layers", "dense")
    assert dense.__name__ == "Dense" and dense.__module__ == "fake_a_mod"
    module = sys.modules["fake_a_mod"]
    assert registry.load("layers", "dense") is dense
    assert registry.load("layers", "Fake_A:dense") is dense  # names normalized like pip does
    assert sys.modules["fake_a_mod"] is module


def test_not_found_is_a_lookup_error_with_suggestions(plugin_site):
    plugin_site.add("fake-a", {"axplug.layers": {"dense": "fake_a_mod:Dense"}})
    with pytest.raises(ComponentNotFoundError) as info:
        registry.load("layers", "dnse")
    assert isinstance(info.value, LookupError)
    message = str(info.value)
    assert "did you mean 'dense'?" in message
    assert "linear" in message and "rms_norm" in message  # lists what is available
    with pytest.raises(ComponentNotFoundError, match="exists as kind layers"):
        registry.load("modifiers", "dense")


def test_unknown_kind_names_the_valid_ones(plugin_site):
    with pytest.raises(ValueError, match="valid kinds: layers, modifiers, kernels"):
        registry.load("layer", "dense")


def test_broken_plugin_is_reported_and_isolated(plugin_site, tmp_path):
    attempts = tmp_path / "attempts.txt"
    plugin_site.add(
        "fake-bad",
        {"axplug.layers": {"bad": "fake_bad_mod:Bad"}},
        modules={"fake_bad_mod": f"open({str(attempts)!r}, 'a').write('x')\n" + EXPLODES},
    )
    plugin_site.add(
        "fake-good",
        {"axplug.layers": {"dense": "fake_good_mod:Dense"}},
        modules={"fake_good_mod": DENSE},
    )
    assert _one("layers", "bad", "fake-bad").status == "ok"  # not known to fail before import
    with pytest.raises(PluginLoadError) as info:
        registry.load("layers", "bad")
    assert isinstance(info.value, ImportError) and not isinstance(info.value, LookupError)
    message = str(info.value)
    for part in (
        "layers 'bad'",
        "fake-bad 1.0",
        "fake_bad_mod:Bad",
        "RuntimeError: boom at import",
    ):
        assert part in message
    assert info.value.component.distribution == "fake-bad"
    bad = _one("layers", "bad", "fake-bad")
    assert (bad.status, bad.reason) == ("broken", "RuntimeError: boom at import")
    assert registry.load("layers", "dense").__name__ == "Dense"
    with pytest.raises(PluginLoadError, match="boom at import"):
        registry.load("layers", "bad")
    assert attempts.read_text() == "x"  # the failure is cached, not retried


@pytest.mark.parametrize(
    ("source", "value", "reason"),
    [
        (DENSE, "fake_odd_mod:Missing", "AttributeError"),
        ("import sys\nsys.exit(3)\n", "fake_odd_mod:Dense", "SystemExit: 3"),
        (DENSE, "fake_odd_mod:Dense", None),
    ],
)
def test_load_failures_never_escape_as_anything_but_plugin_load_error(
    plugin_site, source, value, reason
):
    plugin_site.add(
        "fake-odd", {"axplug.kernels": {"odd": value}}, modules={"fake_odd_mod": source}
    )
    if reason is None:
        assert registry.load("kernels", "odd").__name__ == "Dense"
    else:
        with pytest.raises(PluginLoadError, match=reason):
            registry.load("kernels", "odd")
        assert _one("kernels", "odd", "fake-odd").reason.startswith(reason)


@pytest.mark.parametrize(
    ("api", "expected"),
    [
        ("2", ["declares plugin API 2", "supports plugin API 1", "upgrade axplug"]),
        ("0", ["declares plugin API 0", "pip install -U fake-plug"]),
        (None, ["declares no plugin API", '[project.entry-points."axplug.plugin_api"]']),
    ],
)
def test_plugin_outside_the_api_window_is_incompatible_and_never_imported(
    plugin_site, api, expected
):
    plugin_site.add(
        "fake-plug",
        {"axplug.layers": {"dense": "fake_plug_mod:Dense"}},
        api=api,
        modules={"fake_plug_mod": EXPLODES},
    )
    component = _one("layers", "dense", "fake-plug")
    assert component.status == "incompatible"
    for part in expected:
        assert part in component.reason
    with pytest.raises(ComponentUnavailableError, match="is incompatible"):
        registry.load("layers", "dense")
    assert "dense" not in registry.names("layers")
    assert "fake_plug_mod" not in sys.modules


def test_api_declared_with_a_minor_version_is_compatible(plugin_site):
    plugin_site.add("fake-a", {"axplug.layers": {"dense": "m:D"}}, api="1.4")
    assert _one("layers", "dense", "fake-a").status == "ok"


def test_name_collision_needs_a_qualified_name(plugin_site):
    for dist, module in (("fake-a", "fake_rope_a"), ("fake-b", "fake_rope_b")):
        plugin_site.add(
            dist, {"axplug.layers": {"rope": f"{module}:Dense"}}, modules={module: DENSE}
        )
    a, b = _one("layers", "rope", "fake-a"), _one("layers", "rope", "fake-b")
    assert (a.status, b.status) == ("conflict", "conflict")
    assert "fake-b:rope" in a.reason
    with pytest.raises(ComponentConflictError) as info:
        registry.load("layers", "rope")
    assert isinstance(info.value, LookupError)
    assert "'fake-a:rope'" in str(info.value) and "'fake-b:rope'" in str(info.value)
    assert registry.load("layers", "fake-b:rope").__module__ == "fake_rope_b"
    assert registry.load("layers", "fake-a:rope").__module__ == "fake_rope_a"
    names = registry.names("layers")
    assert "fake-a:rope" in names and "fake-b:rope" in names and "rope" not in names


def test_disabling_one_side_of_a_collision_resolves_it(plugin_site, monkeypatch):
    for dist, module in (("fake-a", "fake_rope_a"), ("fake-b", "fake_rope_b")):
        plugin_site.add(
            dist, {"axplug.layers": {"rope": f"{module}:Dense"}}, modules={module: DENSE}
        )
    monkeypatch.setenv("AXPLUG_DISABLE_PLUGINS", "fake-b")
    assert registry.load("layers", "rope").__module__ == "fake_rope_a"
    assert _one("layers", "rope", "fake-a").status == "ok"


def test_disable_env_marks_distributions_but_never_the_core(plugin_site, monkeypatch):
    plugin_site.add(
        "fake-a", {"axplug.layers": {"dense": "fake_a_mod:Dense"}}, modules={"fake_a_mod": EXPLODES}
    )
    plugin_site.add("fake-b", {"axplug.layers": {"other": "fake_b_mod:Dense"}})
    monkeypatch.setenv("AXPLUG_DISABLE_PLUGINS", " Fake_A ,axplug")
    a = _one("layers", "dense", "fake-a")
    assert (a.status, a.reason) == ("disabled", "AXPLUG_DISABLE_PLUGINS lists it")
    assert _one("layers", "other", "fake-b").status == "ok"
    assert _one("layers", "linear", "axplug").status == "ok"
    with pytest.raises(ComponentUnavailableError, match="is disabled"):
        registry.load("layers", "dense")
    assert "fake_a_mod" not in sys.modules


def test_a_saved_config_naming_a_disabled_plugins_class_is_refused(plugin_site, monkeypatch):
    # `module:Qualname` in a saved config would import the plugin behind the user's back.
    from axplug.config import ConfigError, from_dict

    plugin_site.add(
        "fake-a", {"axplug.layers": {"dense": "fake_a_mod:Dense"}}, modules={"fake_a_mod": EXPLODES}
    )
    monkeypatch.setenv("AXPLUG_DISABLE_PLUGINS", "fake-a")
    for trusted in (True, False):
        message = r"'fake_a_mod:Dense' is code of fake-a, which is disabled \(AXPLUG_DISABLE_"
        with pytest.raises(ConfigError, match=message):
            from_dict({"klass": "fake_a_mod:Dense"}, trusted=trusted)
    assert "fake_a_mod" not in sys.modules
    monkeypatch.setenv("AXPLUG_LOAD_PLUGINS", "")  # core only: the same
    monkeypatch.delenv("AXPLUG_DISABLE_PLUGINS")
    with pytest.raises(ConfigError, match="is code of fake-a, which is disabled"):
        from_dict({"klass": "fake_a_mod:Dense"}, trusted=True)
    assert "fake_a_mod" not in sys.modules


@pytest.mark.parametrize(("allow", "enabled"), [("", set()), ("fake_b", {"fake-b"})])
def test_load_plugins_env_is_an_allow_list(plugin_site, monkeypatch, allow, enabled):
    plugin_site.add("fake-a", {"axplug.layers": {"one": "m:D"}})
    plugin_site.add("fake-b", {"axplug.layers": {"two": "m:D"}})
    monkeypatch.setenv("AXPLUG_LOAD_PLUGINS", allow)
    statuses = {c.distribution: c.status for c in registry.discover()}
    assert statuses["axplug"] == "ok"
    for dist in ("fake-a", "fake-b"):
        assert statuses[dist] == ("ok" if dist in enabled else "disabled")


def test_unknown_entry_point_group_is_reported_broken(plugin_site):
    plugin_site.add("fake-a", {"axplug.layer": {"dense": "m:D"}})
    (component,) = _mine(registry.discover(), "fake-a")
    assert component.status == "broken"
    assert "did you mean axplug.layers?" in component.reason


def test_resolve_class_finds_registered_components_across_kinds(plugin_site):
    plugin_site.add(
        "fake-a",
        {"axplug.modifiers": {"widen": "fake_a_mod:Dense"}},
        modules={"fake_a_mod": MODIFIER},
    )
    assert resolve_class("widen").__module__ == "fake_a_mod"
    assert resolve_class("fake-a:widen").__module__ == "fake_a_mod"


HOOKS = """
from axplug.api import hookimpl

calls = []

@hookimpl
def on_step_end(trainer, step, metrics):
    calls.append((step, metrics["loss"]))
"""
TYPO_HOOKS = """
from axplug.api import hookimpl

@hookimpl
def on_stp_end(trainer, step, metrics):
    pass
"""
WRONG_ARGS_HOOKS = """
from axplug.api import hookimpl

@hookimpl
def on_train_end(trainer, metrics, extra):
    pass
"""


def test_hooks_plugin_is_called_through_the_plugin_manager(plugin_site):
    plugin_site.add(
        "fake-hooks", {"axplug.hooks": {"log": "fake_hooks_mod"}}, modules={"fake_hooks_mod": HOOKS}
    )
    pm = registry.plugin_manager()
    pm.hook.on_step_end(trainer=None, step=7, metrics={"loss": 0.5})
    assert sys.modules["fake_hooks_mod"].calls == [(7, 0.5)]
    assert pm.get_plugin("fake-hooks:log") is sys.modules["fake_hooks_mod"]


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (TYPO_HOOKS, "unknown hook(s) on_stp_end (did you mean on_step_end?)"),
        (WRONG_ARGS_HOOKS, "invalid hook implementation"),
        (EXPLODES, "RuntimeError: boom at import"),
    ],
)
def test_invalid_hooks_plugin_is_broken_and_others_still_run(plugin_site, source, reason):
    plugin_site.add(
        "fake-typo", {"axplug.hooks": {"bad": "fake_typo_mod"}}, modules={"fake_typo_mod": source}
    )
    plugin_site.add(
        "fake-hooks", {"axplug.hooks": {"log": "fake_hooks_mod"}}, modules={"fake_hooks_mod": HOOKS}
    )
    for _ in range(2):  # a second manager sees the recorded failure, not a crash
        pm = registry.plugin_manager()
        assert pm.get_plugin("fake-typo:bad") is None
        pm.hook.on_step_end(trainer=None, step=1, metrics={"loss": 2.0})
    bad = _one("hooks", "bad", "fake-typo")
    assert bad.status == "broken" and reason in bad.reason
    assert sys.modules["fake_hooks_mod"].calls == [(1, 2.0), (1, 2.0)]


def test_plugin_manager_registers_caller_objects_and_validates_them(plugin_site):
    class Recorder:
        def __init__(self):
            self.saved = []

        @axplug.api.hookimpl
        def on_checkpoint_saved(self, trainer, step, path):
            self.saved.append((step, path))

    recorder = Recorder()
    pm = registry.plugin_manager(recorder)
    pm.hook.on_checkpoint_saved(trainer=None, step=3, path="/ckpt/3")
    assert recorder.saved == [(3, "/ckpt/3")]

    class Typo:
        @axplug.api.hookimpl
        def on_checkpoint_save(self, trainer, step, path):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="on_checkpoint_save"):
        registry.plugin_manager(Typo())


def test_a_third_party_reusing_a_first_party_name_does_not_break_the_core(
    plugin_site, tmp_path, caplog, capsys
):
    """A third-party `file` storage and `rope` modifier: the plain names keep meaning the
    first-party components, the others load qualified, and the checks report the conflict."""
    import logging

    from axplug.checkpoint import storage_for
    from axplug.cli import main

    plugin_site.keep_installed("axplug-attention")
    plugin_site.add(
        "fake-thirdparty",
        {
            "axplug.storage": {"file": "fake_tp:Dense"},
            "axplug.modifiers": {"rope": "fake_tp_modifier:Dense"},
        },
        modules={"fake_tp": STORAGE, "fake_tp_modifier": MODIFIER},
    )
    with caplog.at_level(logging.WARNING, logger="axplug.registry"):
        assert registry.entry("storage", "file").distribution == "axplug"
    assert "the first-party one from axplug is used" in caplog.text
    assert "'fake-thirdparty:file'" in caplog.text
    assert registry.load("storage", "fake-thirdparty:file").__module__ == "fake_tp"
    assert registry.entry("modifiers", "rope").distribution == "axplug-attention"
    assert "file" in registry.names("storage")
    assert "fake-thirdparty:file" in registry.names("storage")
    storage_for(str(tmp_path))  # local checkpoints and `checkpoints ls` work as before
    from axplug.presets import preset_config

    preset_config("llama-tiny")  # its `rope` modifier is the installed first-party one
    assert main(["list", "--check"]) == 1
    assert "fake-thirdparty registers storage 'file', a first-party name" in capsys.readouterr().err
    assert main(["doctor"]) == 1
    assert "reuses a first-party name" in capsys.readouterr().out


def test_first_party_is_what_the_metadata_declares_within_the_project_namespace(plugin_site):
    """The `first-party` entry makes an `axplug-*` distribution win its plain names; outside
    the namespace the claim is ignored; two claims on one name are a plain conflict."""
    from axplug.registry import FIRST_PARTY_ENTRY

    assert FIRST_PARTY_ENTRY == "first-party"
    layer = {"fake_fp": "class D:\n    pass\n"}
    plugin_site.add("axplug-fakefp", {"axplug.layers": {"dense": "fake_fp:D"}}, modules=layer,
                    first_party=True)  # fmt: skip
    plugin_site.add("fake-rival", {"axplug.layers": {"dense": "fake_fp:D"}})
    plugin_site.add("evil-claimer", {"axplug.layers": {"norm2": "fake_fp:D"}}, first_party=True)
    plugin_site.add("fake-other", {"axplug.layers": {"norm2": "fake_fp:D"}})
    plugin_site.add("axplug-unmarked", {"axplug.layers": {"solo": "fake_fp:D"}})
    status = {c.qualified_name: c for c in registry.discover("layers")}
    assert status["axplug:linear"].first_party  # the core declares it like every plugin
    assert status["axplug-fakefp:dense"].first_party
    assert not status["evil-claimer:norm2"].first_party  # not in the axplug- namespace
    assert not status["axplug-unmarked:solo"].first_party  # the name alone is not enough
    assert status["axplug-fakefp:dense"].status == "conflict"  # the marker is no API version
    assert "means this first-party one" in status["axplug-fakefp:dense"].reason
    assert registry.entry("layers", "dense").distribution == "axplug-fakefp"
    with pytest.raises(registry.ComponentConflictError, match="evil-claimer:norm2"):
        registry.entry("layers", "norm2")
    assert [c.qualified_name for c in registry.shadowing_first_party(registry.discover())] == [
        "fake-rival:dense"
    ]


def test_two_first_party_claims_on_one_name_are_never_a_silent_win(plugin_site):
    plugin_site.add("axplug-claimer", {"axplug.storage": {"file": "fake_claim:S"}},
                    first_party=True)  # fmt: skip
    with pytest.raises(registry.ComponentConflictError, match="'axplug-claimer:file'"):
        registry.entry("storage", "file")
    assert registry.entry("storage", "axplug:file").distribution == "axplug"


def test_a_plugin_that_hangs_at_import_is_reported_not_waited_for(plugin_site, monkeypatch, capsys):
    from axplug.cli import list_cmd, main

    plugin_site.add(
        "fake-slow",
        {"axplug.hooks": {"slow": "fake_slow_mod"}, "axplug.layers": {"slowl": "fake_slow_l:D"}},
        modules={
            "fake_slow_mod": "import time\ntime.sleep(30)\n",
            "fake_slow_l": "import time\ntime.sleep(30)\nD = 1\n",
        },
    )
    monkeypatch.setattr(list_cmd, "IMPORT_TIMEOUT_S", 0.5)
    start = __import__("time").monotonic()
    assert main(["list", "--check", "--json"]) == 1
    assert __import__("time").monotonic() - start < 10
    rows = {r["name"]: r for r in __import__("json").loads(capsys.readouterr().out)}
    for name in ("slow", "slowl"):
        assert rows[name]["status"] == "broken"
        assert "import did not finish within 0.5 s" in rows[name]["reason"]


def test_a_hooks_plugin_broken_at_import_is_warned_about(plugin_site, caplog):
    import logging

    plugin_site.add(
        "fake-hookbad",
        {"axplug.hooks": {"bad": "fake_hookbad"}},
        modules={"fake_hookbad": EXPLODES},
    )
    with caplog.at_level(logging.WARNING, logger="axplug.registry"):
        registry.plugin_manager()
    assert "cannot load hooks 'bad' from fake-hookbad" in caplog.text
    assert "its hooks will not run" in caplog.text


# ----------------------------------------------------------- kind checks at load (api.kinds)

NOT_ANYTHING = '''
class Dense:
    """Of no kind at all."""

THING = 42
'''
ARCHITECTURE = """
class Family:
    architecture = "FakeForCausalLM"
    model_type = "fake"

    def base_config(self, fields):
        return None

    def tensors(self, model):
        return {}


class HalfFamily:
    architecture = "FakeForCausalLM"

    def tensors(self, model):
        return {}
"""
WRITER = """
from axplug.summary import SummaryWriter


class Dense(SummaryWriter):
    def write(self, step, scalars):
        pass
"""
INPUT = """
from axplug.input import Input


class Dense(Input):
    def iter_from(self, step):
        return iter(())
"""
COMMAND = '''
"""`axplug fake`: a command."""


def add_parser(subparsers):
    subparsers.add_parser("fake")
'''


@pytest.mark.parametrize(
    ("kind", "good", "bad", "missing"),
    [
        ("layers", (LAYER, "Dense"), "Dense", "a subclass of axplug.layers.base.BaseLayer"),
        (
            "modifiers",
            (MODIFIER, "Dense"),
            "Dense",
            "subclass of axplug.config.tree.ConfigModifier",
        ),
        ("storage", (STORAGE, "Dense"), "Dense", "subclass of axplug.checkpoint.storage.Storage"),
        ("inputs", (INPUT, "Dense"), "Dense", "a subclass of axplug.input.base.Input"),
        ("summary_writers", (WRITER, "Dense"), "Dense", "axplug.summary.base.SummaryWriter"),
        ("kernels", (LAYER, "Dense"), "Dense", "no is_supported, __call__ of axplug.api.Kernel"),
        ("architectures", (ARCHITECTURE, "Family"), "Dense", "no architecture, model_type, base"),
        ("architectures", (ARCHITECTURE, "HalfFamily"), None, "no model_type, base_config of"),
        ("presets", None, "Dense", "an instance of axplug.presets.Preset"),
        ("mesh_rules", None, "THING", "a function returning a MeshRule.Config"),
        ("commands", (COMMAND, None), None, "has no add_parser(subparsers)"),
    ],
)
def test_load_checks_the_object_against_its_kind(plugin_site, kind, good, bad, missing):
    """Like pluggy's check of a hookimpl at registration: an object that is not what its kind
    declares is a broken component (failure `kind`) naming the plugin and what is missing."""
    entries = {}
    modules = {"fake_nothing": NOT_ANYTHING}
    if good is not None:
        source, attr = good
        modules["fake_good_kind"] = source
        entries["good"] = f"fake_good_kind:{attr}" if attr else "fake_good_kind"
        if bad is None and attr != "Dense" and kind == "architectures":  # HalfFamily
            entries = {"bad": entries.pop("good")}
    if bad is not None:
        entries["bad"] = f"fake_nothing:{bad}"
    if kind == "commands":
        entries["bad"] = "fake_nothing"
    plugin_site.add("fake-kinds", {f"axplug.{kind}": entries}, modules=modules)
    if "good" in entries:
        assert registry.load(kind, "good") is not None
        assert _one(kind, "good", "fake-kinds").failure is None
    with pytest.raises(PluginLoadError, match="fake-kinds") as info:
        registry.load(kind, "bad")
    assert missing in str(info.value)
    assert f"is not a {kind} component" in str(info.value)
    broken = _one(kind, "bad", "fake-kinds")
    assert (broken.status, broken.failure) == ("broken", "kind")
    assert missing in broken.reason


def test_failures_record_their_kind(plugin_site):
    plugin_site.add("fake-import", {"axplug.layers": {"boom": "fake_boom:X"}}, modules={
        "fake_boom": "import not_a_real_module_xyz\n"})  # fmt: skip
    plugin_site.add("fake-gone", {"axplug.layers": {"gone": "fake_gone:Missing"}}, modules={
        "fake_gone": LAYER})  # fmt: skip
    plugin_site.add("fake-future", {"axplug.layers": {"new": "fake_future:Dense"}}, api="9")
    plugin_site.add("fake-group", {"axplug.layres": {"typo": "fake_gone:Dense"}})
    for name in ("boom", "gone"):
        with pytest.raises(PluginLoadError):
            registry.load("layers", name)
    assert _one("layers", "boom", "fake-import").failure == "import"
    assert _one("layers", "gone", "fake-gone").failure == "missing"
    assert _one("layers", "new", "fake-future").failure == "api"
    (typo,) = [c for c in registry.discover() if c.distribution == "fake-group"]
    assert (typo.status, typo.failure) == ("broken", "group")
    assert set(registry.FAILURES) >= {"import", "missing", "api", "group", "kind", "hooks"}


def test_the_declared_protocols_are_what_load_checks():
    from axplug.api import _hf as hf
    from axplug.api import _kinds as kinds
    from axplug.registry import _kinds

    class Full:
        architecture = model_type = "x"

    for name in ("base_config", "tensors"):
        setattr(Full, name, lambda self, *a: None)
    assert _kinds.check_kind("architectures", Full) is None
    declared = {n for n in vars(hf.HFArchitecture) if not n.startswith("_")}
    declared |= set(hf.HFArchitecture.__annotations__)
    # Required: what load checks; optional: what the base declares with a default.
    optional = {"defaults", "aliases", "implied", "config_fields", "checkpoint_prefixes",
                "ignored_tensors"}  # fmt: skip
    assert declared - optional == {
        "architecture",
        "model_type",
        "base_config",
        "tensors",
    }
    assert "add_parser" in vars(kinds.CommandModule)
    assert kinds.RunInfo._fields == ("dir", "max_steps", "every_n_steps", "tokens_per_step")


def test_a_plain_entry_reads_its_kinds_defaults_through_the_declared_base():
    from axplug.api import HFArchitecture, Kernel
    from axplug.registry import conformed

    class Plain:  # written against the protocol, before the bases declared their defaults
        priority = 7

        def is_supported(self, *args):
            return True

        def __call__(self, *args, **kwargs):
            return "ran"

    kernel = conformed(Plain, Kernel)
    assert isinstance(kernel, Plain) and isinstance(kernel, Kernel)
    assert (kernel.priority, kernel.paged, kernel.grouped_matmul) == (7, False, False)
    assert (kernel.supports_linear_bias, kernel.availability(), kernel()) == (False, None, "ran")
    assert type(conformed(Plain, Kernel)) is type(kernel)  # one mixed class per entry class
    instance = Plain()
    instance.priority = 9
    seen = conformed(instance, Kernel)
    assert seen.priority == 9 and not isinstance(instance, Kernel)  # the entry's own object kept

    class Derived(Kernel):
        paged = True

    derived = Derived()
    assert conformed(derived, Kernel) is derived

    class Family:
        architecture, model_type = "XForCausalLM", "x"

    arch = conformed(Family, HFArchitecture)
    assert (arch.defaults, arch.aliases, arch.implied, arch.config_fields(None)) == ({}, {}, {}, {})

"""`axplug doctor`: the environment report, and each kind of plugin problem named with its fix."""

import argparse
import json
import os

from axplug.cli import doctor_cmd
from fake_plugins import LAYER

DENSE = LAYER

UNAVAILABLE_KERNEL = """
from axplug.api import Unsupported

class Never:
    def is_supported(self, query, key, value, mask, backend):
        return Unsupported("needs a quantum backend")

    def __call__(self, query, key, value, mask, *, scale):
        raise NotImplementedError
"""

UNAVAILABLE_PAGED_KERNEL = """
from axplug.api import Unsupported

class NeverPaged:
    paged = True

    def is_supported(self, query, paged, backend):
        return Unsupported(f"needs {paged.key_pages.shape[0]} kv heads on a quantum backend")

    def __call__(self, query, paged, *, scale):
        raise NotImplementedError
"""

UNAVAILABLE_GROUPED_KERNEL = """
from axplug.api import Unsupported

class NeverGrouped:
    grouped_matmul = True

    def is_supported(self, lhs, rhs, group_sizes, backend):
        return Unsupported(f"needs {rhs.shape[0]} groups on a quantum backend")

    def __call__(self, lhs, rhs, group_sizes):
        raise NotImplementedError
"""

BAD_HOOKS = """
from axplug.api import hookimpl

@hookimpl
def on_step_ended(trainer, step, metrics):
    pass
"""


def doctor(*argv):
    parser = argparse.ArgumentParser(prog="axplug")
    doctor_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["doctor", *argv])
    return args.run(args)


def by_dist(report):
    return {d["distribution"]: d for d in report["distributions"]}


def rows(report, dist):
    return {row["name"]: row for row in by_dist(report)[dist]["components"]}


def test_healthy_environment_reports_and_exits_zero(plugin_site, capsys):
    plugin_site.add("fake-good", {"axplug.layers": {"dense": "fake_good:Dense"}}, modules={
        "fake_good": DENSE})  # fmt: skip
    assert doctor("--json") == 0
    report = json.loads(capsys.readouterr().out)
    env = report["environment"]
    assert env["jax"] and env["jaxlib"] and env["python"]
    assert env["jax_requirement"].startswith("jax") and env["jax_supported"] is True
    assert env["backend"] == "cpu" and len(env["devices"]) == 8  # conftest's fake devices
    assert "xla_force_host_platform_device_count=8" in env["env"]["XLA_FLAGS"]
    # Where a run's programs would go: the session's (JAX_COMPILATION_CACHE_DIR wins).
    assert env["compilation_cache_dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert by_dist(report)["fake-good"]["status"] == "ok"
    assert by_dist(report)["axplug"]["status"] == "ok"
    assert report["ok"] is True
    assert rows(report, "axplug")["paged_xla"]["note"] is None  # runs here


def test_grouped_matmul_kernels_are_asked_about_a_grouped_call(plugin_site, capsys):
    plugin_site.add("fake-grouped", {"axplug.kernels": {"never": "fake_grouped:NeverGrouped"}},
                    modules={"fake_grouped": UNAVAILABLE_GROUPED_KERNEL})  # fmt: skip
    assert doctor("--json") == 0
    note = rows(json.loads(capsys.readouterr().out), "fake-grouped")["never"]["note"]
    assert note == "unavailable here: needs 4 groups on a quantum backend"


def test_paged_kernels_are_asked_about_a_decode_step(plugin_site, capsys):
    plugin_site.add("fake-paged", {"axplug.kernels": {"never": "fake_paged:NeverPaged"}},
                    modules={"fake_paged": UNAVAILABLE_PAGED_KERNEL})  # fmt: skip
    assert doctor("--json") == 0
    note = rows(json.loads(capsys.readouterr().out), "fake-paged")["never"]["note"]
    assert note == "unavailable here: needs 8 kv heads on a quantum backend"


def test_every_problem_is_named_with_its_fix_and_exit_is_nonzero(plugin_site, capsys):
    plugin_site.add("fake-import", {"axplug.layers": {"boom": "fake_import:X"}}, modules={
        "fake_import": "import not_a_real_module_xyz\n"})  # fmt: skip
    plugin_site.add("fake-dangling", {"axplug.layers": {"gone": "fake_dangling:Missing"}},
                    modules={"fake_dangling": DENSE})  # fmt: skip
    plugin_site.add("fake-future", {"axplug.layers": {"new": "fake_future:Dense"}}, api="9")
    plugin_site.add("fake-typo", {"axplug.layers": {"typo": "fake_typo.layres:Dense"}}, modules={
        "fake_typo": DENSE})  # fmt: skip
    plugin_site.add("fake-one", {"axplug.layers": {"dup": "fake_one:Dense"}}, modules={
        "fake_one": DENSE})  # fmt: skip
    plugin_site.add("fake-two", {"axplug.layers": {"dup": "fake_two:Dense"}}, modules={
        "fake_two": DENSE})  # fmt: skip
    plugin_site.add("fake-hooks", {"axplug.hooks": {"h": "fake_hooks"}}, modules={
        "fake_hooks": BAD_HOOKS})  # fmt: skip
    plugin_site.add("fake-kernel", {"axplug.kernels": {"never": "fake_kernel:Never"}}, modules={
        "fake_kernel": UNAVAILABLE_KERNEL})  # fmt: skip
    plugin_site.add("fake-kind", {"axplug.layers": {"plain": "fake_kind:Plain"}}, modules={
        "fake_kind": "class Plain:\n    pass\n"})  # fmt: skip
    assert doctor("--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False

    boom = rows(report, "fake-import")["boom"]
    assert boom["problem"] == "import error"
    assert "ModuleNotFoundError: No module named 'not_a_real_module_xyz'" in boom["reason"]
    assert rows(report, "fake-dangling")["gone"]["problem"] == "entry point points at nothing"
    # The entry's own module is missing (a typo in the value), unlike `fake-import` above.
    typo = rows(report, "fake-typo")["typo"]
    assert typo["problem"] == "entry point points at nothing", typo
    assert "No module named 'fake_typo.layres'" in typo["reason"]
    new = rows(report, "fake-future")["new"]
    assert new["problem"] == "plugin API mismatch" and "upgrade axplug" in new["reason"]
    for dist in ("fake-one", "fake-two"):
        assert rows(report, dist)["dup"]["problem"] == "name collision"
        assert by_dist(report)[dist]["status"] == "ok"  # a collision is resolvable: not broken
    hooks = rows(report, "fake-hooks")["h"]
    assert hooks["problem"] == "hooks the core does not define"
    assert "on_step_ended" in hooks["reason"] and "on_step_end" in hooks["reason"]
    plain = rows(report, "fake-kind")["plain"]
    assert (plain["failure"], plain["problem"]) == ("kind", "not what its kind declares")
    assert "must be a subclass of axplug.layers.base.BaseLayer" in plain["reason"]
    assert boom["failure"] == "import" and typo["failure"] == "missing"
    never = rows(report, "fake-kernel")["never"]
    assert never["status"] == "ok" and "needs a quantum backend" in never["note"]
    statuses = {d["distribution"]: d["status"] for d in report["distributions"]}
    assert statuses["fake-import"] == statuses["fake-hooks"] == "broken"
    assert statuses["fake-future"] == "incompatible"
    assert statuses["axplug"] == "ok"  # one broken plugin never hides the healthy ones


def test_text_report_names_problems(plugin_site, capsys):
    plugin_site.add("fake-import", {"axplug.layers": {"boom": "fake_import:X"}}, modules={
        "fake_import": "raise RuntimeError('no GPU driver')\n"})  # fmt: skip
    assert doctor() == 1
    out = capsys.readouterr().out
    assert "jax " in out and "XLA_FLAGS" in out and "compilation cache" in out
    assert "fake-import 1.0: broken" in out
    assert "layers boom: import error: RuntimeError: no GPU driver" in out
    assert "problems in: fake-import" in out

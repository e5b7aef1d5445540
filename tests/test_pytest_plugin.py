"""The test harness itself (axplug_testing's pytest plugin): the session's compilation cache, the
compile budget, the in-process CLI runner, and library objects that leave jax's settings alone."""

import json
import os
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_testing import (
    production_compiler_options,
    run_cli,
    tiny_train_args,
    tiny_trainer_config,
)

_CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
    "jax_compilation_cache_include_metadata_in_key",
    "jax_enable_compilation_cache",
)


def _settings() -> dict:
    return {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}


def test_the_session_compiles_into_its_own_cache_under_basetemp(tmp_path_factory):
    directory = jax.config.jax_compilation_cache_dir
    assert directory == os.environ["JAX_COMPILATION_CACHE_DIR"]  # children inherit it
    # The session's basetemp (an xdist worker's is a folder in its controller's).
    basetemp = Path(tmp_path_factory.getbasetemp()).resolve()
    assert {basetemp, basetemp.parent} & set(Path(directory).resolve().parents)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0


def test_the_session_compiles_fast_and_production_options_undo_exactly_that():
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_backend_optimization_level=0" in flags
    undo = production_compiler_options()
    assert undo["xla_backend_optimization_level"] == 3  # XLA's default
    assert all(any(f.startswith(f"--{name}=") for f in flags) for name in undo), (undo, flags)
    # XLA takes them per program (an unknown name would raise here).
    f = jax.jit(lambda x: jnp.tanh(x) * 2.0, compiler_options=undo)
    np.testing.assert_allclose(f(jnp.ones(3)), 2 * np.tanh(1.0), rtol=1e-6)


def test_building_a_trainer_leaves_the_compilation_cache_settings_as_they_were(tmp_path):
    before = _settings()
    cfg = tiny_trainer_config(tmp_path, f"compilation_cache_dir={str(tmp_path / 'xla')!r}")
    cfg.instantiate()
    assert _settings() == before
    assert not (tmp_path / "xla").exists()


def test_train_uses_its_cache_only_while_it_runs(tmp_path):
    from axplug.trainer.run import train

    before = _settings()
    train(tiny_trainer_config(tmp_path / "run", f"compilation_cache_dir={str(tmp_path / 'xla')!r}"))
    assert _settings() == before
    assert any((tmp_path / "xla").iterdir())  # the run's programs went to its own cache


def test_commands_as_documented_use_the_sessions_caches(tmp_path, monkeypatch):
    # A run with the Trainer's default cache directory, as the docs' commands run: under the
    # session's JAX_COMPILATION_CACHE_DIR it keeps the session's settings (and its programs);
    # without one it compiles into $AXPLUG_CACHE/xla, which the session points under basetemp.
    from axplug.paths import cache_path

    basetemp = Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).parent
    assert Path(os.environ["AXPLUG_CACHE"]).parent == basetemp
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AXPLUG_CACHE", str(tmp_path / "cache"))
    assert cache_path("~/.cache/axplug/xla") == str(tmp_path / "cache" / "xla")
    assert cache_path("~/.cache/axplugins") == str(tmp_path / "home" / ".cache" / "axplugins")

    def default_cache_args(run_dir):
        args = tiny_train_args(run_dir)
        at = args.index("compilation_cache_dir=None")
        del args[at - 1 : at + 1]  # its --set too: the Trainer's default directory
        return args

    before = _settings()
    code, _, err = run_cli(*default_cache_args(tmp_path / "run"))
    assert code == 0, err
    assert _settings() == before and not (tmp_path / "cache" / "xla").exists()
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    code, _, err = run_cli(*default_cache_args(tmp_path / "run2"))
    assert code == 0, err
    assert _settings() == before and any((tmp_path / "cache" / "xla").iterdir())
    assert not (tmp_path / "home").exists()


def test_a_tiny_run_writes_nothing_under_the_home_cache(tmp_path, monkeypatch):
    from axplug.trainer.run import train

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    train(tiny_trainer_config(tmp_path / "run"))
    code, _, err = run_cli(*tiny_train_args(tmp_path / "cli"))  # the same programs: cached
    assert code == 0, err
    assert not (tmp_path / "home" / ".cache" / "axplug").exists()


def test_the_cli_runner_returns_the_exit_code_and_both_streams(tmp_path):
    ok = run_cli("list", "--kind", "presets")
    assert ok.exit_code == 0 and "gpt-tiny" in ok.stdout
    bad = run_cli("train", "--preset", "no-such-preset", "--output-dir", str(tmp_path))
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error:") and "no-such-preset" in bad.stderr
    assert bad.stdout == ""


def test_the_cli_runner_returns_argparse_exits_as_codes():
    result = run_cli("--no-such-flag")
    assert result.exit_code == 2 and "usage" in result.stderr


_BUDGETED = """
import jax
import jax.numpy as jnp


def add_one(x):
    return x + 1


def test_one():
    jax.jit(add_one)(jnp.ones(3))


def test_two():
    jax.jit(lambda x: x * 2)(jnp.ones(3))
"""

# test_one's program again, after the in-memory caches are dropped: answered by the session's
# persistent cache (free), or with that turned off, compiled again (which the budget counts).
_REUSED = """

def test_three():
    jax.clear_caches()
    jax.jit(add_one)(jnp.ones(3))
"""
_RECOMPILED = """

def test_three(cold_compiles):
    jax.clear_caches()
    jax.jit(add_one)(jnp.ones(3))
"""


def _session(pytester, monkeypatch, source: str, *args: str):
    pytester.makepyfile(test_costs=textwrap.dedent(source))
    here = str(Path(__file__).parent)  # pytest_costs, the suite's cost plugin
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "")  # a session of its own, not a worker
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "pytest_costs", *args)


def test_the_compile_budget_fails_a_session_that_compiles_a_program_again(pytester, monkeypatch):
    budget = pytester.path / "budget.json"
    option = f"--compile-budget={budget}"
    written = _session(pytester, monkeypatch, _BUDGETED, option, "--write-compile-budget")
    assert written.ret == 0
    counted = json.loads(budget.read_text())["backend_compiles"]
    assert 2 <= counted < 10  # each test's program (and jnp.ones'), so one more is over 10%
    written.stdout.fnmatch_lines(
        ["*axplug test costs*", f"{counted} backend compiles, * CPU seconds in 2 tests",
         "most CPU seconds:", "*test_costs.py::test_*"]
    )  # fmt: skip

    reused = _session(pytester, monkeypatch, _BUDGETED + _REUSED, option)
    assert reused.ret == 0
    reused.stdout.fnmatch_lines([f"compile budget: {counted} backend compiles of {counted}*"])

    recompiled = _session(pytester, monkeypatch, _BUDGETED + _RECOMPILED, option)
    assert recompiled.ret == pytest.ExitCode.TESTS_FAILED
    recompiled.assert_outcomes(passed=3)
    recompiled.stdout.fnmatch_lines(
        ["most backend compiles:", "*test_costs.py::test_three", "*error: * backend compiles, "
         f"over the budget of {counted} + 10%*"]
    )  # fmt: skip


def test_an_unreadable_budget_is_one_error_line(pytester, monkeypatch):
    budget = pytester.path / "budget.json"
    budget.write_text("not json")
    result = _session(pytester, monkeypatch, _BUDGETED, f"--compile-budget={budget}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"error: compile budget {budget} is unreadable*"])

"""axplug's pytest plugin, loaded wherever axplug is installed (entry point `pytest11`).

- One persistent compilation cache per session, under pytest's basetemp and inherited by child
  processes (`JAX_COMPILATION_CACHE_DIR`): a program the session has compiled compiles again
  only in a test that asks for `cold_compiles`. XLA compiles without LLVM optimizations.
  axplug's own caches (`AXPLUG_CACHE`) are the session's too, never `~/.cache/axplug`.
- The garbage collector leaves alone what was imported and collected before the tests.
- Fixtures: `axplug_cli` (the `axplug` command in-process), `plugin_site` (fake plugin
  distributions), `cold_compiles`, and runs trained once per session (`gpt_tiny_trained`, and
  any preset's with `trained_run(preset, *overrides)`; `gpt_tiny_run`: a copy per test).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from axplug_testing._cli import CliResult, run_cli
from axplug_testing._fake_site import FakeSite

# Every program cached; op metadata left out of the key (jax's default), since it holds the
# caller's stack: the same train step traced from two tests would be two entries.
_CACHE_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
    "jax_compilation_cache_include_metadata_in_key": False,
}


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker shares its controller's cache (inherited environment)
    flags = os.environ.get("XLA_FLAGS", "")
    fast = [f"--{name}={v}" for name, (v, _) in _fast_compile_flags().items() if name not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *fast]).strip()
    basetemp = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    cache = basetemp / "xla-cache"
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # axplug's own caches (a run's `~/.cache/axplug/xla`, mirrors, tokenizers) too: a command
    # run as documented never reads or writes the user's.
    os.environ["AXPLUG_CACHE"] = str(basetemp / "axplug-cache")
    os.environ.update({name.upper(): str(v).lower() for name, v in _CACHE_SETTINGS.items()})
    if "jax" in sys.modules:  # imported before this plugin read the environment: tell it
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in {"jax_compilation_cache_dir": str(cache), **_CACHE_SETTINGS}.items():
            sys.modules["jax"].config.update(name, value)
        compilation_cache.reset_cache()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keeps Python's cyclic garbage collector off the imports and collected tests.

    Tracing makes many short-lived objects; each gen-2 collection walked every module jax and
    the tests imported (5.0 s of 80 s in test_trainer + test_sharding). Frozen after collection,
    with a larger young generation: 1.4 s.
    """
    import gc

    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


def _fast_compile_flags() -> dict[str, tuple[str, object]]:
    """{XLA flag: (the session's value, XLA's default)} for flags that compile tests' tiny
    programs faster.

    Tests run each program once or twice, so optimizing it costs more than it saves: LLVM at
    -O0 compiled a test module's programs ~1.4x faster, and XLA's CPU loop emitters instead of
    its fusion emitters the whole suite another 1.27x. One LLVM module per program instead of
    32 compiled on a thread pool took 0.7x the CPU time per train step (the suite's workers
    already keep both cores busy). XLA aborts on a flag it does not know, so the emitter flag
    goes only to the jaxlib versions it was measured with.
    """
    from importlib.metadata import version

    flags: dict[str, tuple[str, object]] = {
        "xla_backend_optimization_level": ("0", 3),
        "xla_cpu_parallel_codegen_split_count": ("1", 32),
    }
    if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11):
        flags["xla_cpu_use_fusion_emitters"] = ("false", True)
    return flags


def production_compiler_options() -> dict[str, object]:
    """`compiler_options` for `jax.jit` (or `.compile`) that undo the session's fast-compile
    flags: for a test whose claim is about the compiler users run, e.g. two different programs
    that must agree bit for bit."""
    return {name: default for name, (_, default) in _fast_compile_flags().items()}


def xla_flags(devices: int) -> str:
    """This session's XLA_FLAGS with `devices` fake CPU devices: for a child process that must
    compile as this one does (the same flags give the same numerics)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def axplug_cli():
    """Runs `axplug ARGS...` in this process through the real `main`: `axplug_cli("list")` ->
    CliResult(exit_code, stdout, stderr)."""
    return run_cli


@pytest.fixture
def cold_compiles():
    """Turns the persistent compilation cache off for the test: its programs compile cold."""
    import jax

    before = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A `FakeSite` of fake plugin distributions, first on sys.path (subprocesses: `site.env()`).

    AXPLUG_DISABLE_PLUGINS / AXPLUG_LOAD_PLUGINS are cleared and the registry cache is reset
    before and after, so each test discovers exactly the core plus what it installs.
    """
    import importlib_metadata

    from axplug import registry

    site = FakeSite(tmp_path / "site-packages")
    monkeypatch.syspath_prepend(str(site.path))
    # Only the core and the fake distributions are discovered, whatever else is installed.
    monkeypatch.setattr(importlib_metadata, "distributions", site.distributions)
    monkeypatch.delenv("AXPLUG_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("AXPLUG_LOAD_PLUGINS", raising=False)
    # `axplug list`'s description cache: per test, so a fake module's docstring is read fresh.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.reset()
    yield site
    registry.reset()
    site.forget_modules()


def _trained(tmp_path_factory, name: str, preset: str, *overrides: str) -> Path:
    """The run `name`, trained by the first xdist worker that asks (under a lock in the
    controller's basetemp) and read by the others: one run per session, not per worker."""
    import fcntl

    from axplug.summary import JsonlWriter
    from axplug.trainer.run import train
    from axplug_testing._trainer import tiny_trainer_config

    root = Path(tmp_path_factory.getbasetemp())
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the controller's basetemp, shared by its workers
    out, done = root / f"trained-{name}", root / f"trained-{name}.done"
    with open(root / f"trained-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():  # a worker that failed half way left no marker: train again
            shutil.rmtree(out, ignore_errors=True)
            writers = [JsonlWriter.default_config()]
            train(tiny_trainer_config(out, *overrides, preset=preset, summary_writers=writers))
            done.touch()
    return out


@pytest.fixture(scope="session")
def gpt_tiny_trained(tmp_path_factory) -> Path:
    """gpt-tiny trained once per session (2 steps of 8 x 32 tokens, checkpointed at step 2,
    metrics.jsonl). Shared: read it, or copy it first (`gpt_tiny_run` is a copy per test)."""
    return _trained(tmp_path_factory, "gpt-tiny-run", "gpt-tiny")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Callable[..., Path]:
    """`trained_run(preset, *overrides)`: that run trained once per session, as
    `gpt_tiny_trained` (a plugin's preset too). Shared: read it, or `copy_run` it first."""
    return lambda preset, *overrides: _trained(
        tmp_path_factory, "-".join((preset, *overrides)), preset, *overrides
    )


def copy_run(source: Path, destination: Path) -> Path:
    """A copy of the run directory `source` at `destination`, for a test (or module) to change."""
    return Path(shutil.copytree(source, destination))


@pytest.fixture
def gpt_tiny_run(gpt_tiny_trained, tmp_path) -> Path:
    """A copy of `gpt_tiny_trained` that the test may change."""
    return copy_run(gpt_tiny_trained, tmp_path / "gpt-tiny")


__all__ = ["CliResult", "FakeSite", "copy_run", "production_compiler_options", "xla_flags"]

"""Test setup: 8 fake CPU devices for mesh tests, set before jax is imported."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A `FakeSite` of fake plugin distributions, first on sys.path (subprocesses: `site.env()`).

    AXPLUG_DISABLE_PLUGINS / AXPLUG_LOAD_PLUGINS are cleared and the registry cache is reset
    before and after, so each test discovers exactly the core plus what it installs.
    """
    import importlib_metadata

    from axplug import registry
    from fake_plugins import FakeSite

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


@pytest.fixture(autouse=True)
def _axplug_logging_reset():
    """`axplug train` in-process gives the `axplug` logger its own handler and stops it
    propagating; undo that after each test, so caplog (on the root) sees axplug's records."""
    yield
    import logging

    logger = logging.getLogger("axplug")
    for handler in list(logger.handlers):
        if type(handler).__name__ == "_Handler":
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's compiled programs and traces after each test module: one process runs the
    whole suite, and their memory would otherwise grow module after module."""
    yield
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()

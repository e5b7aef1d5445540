"""Fixtures of the core's own tests (the root conftest.py sets up the devices)."""

import pytest


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

"""Fake installed plugin distributions on disk (the `plugin_site` fixture), for registry and
CLI tests of the core and of plugins."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import importlib_metadata

from axplug.registry._component import distribution_key, normalize

__all__ = ["FakeSite"]

# Subprocesses started with `FakeSite.env()` import this first (the site is on PYTHONPATH).
_SITECUSTOMIZE = """
import importlib_metadata as _m
from pathlib import Path as _P

_all = _m.distributions


def _visible(d, site=_P({site!r})):
    if site in _P(str(getattr(d, "_path", ""))).parents or (d.name or "").lower() == "axplug":
        return True
    return "axplug." not in (d.read_text("entry_points.txt") or "")


_m.distributions = lambda **kw: [d for d in _all(**kw) if _visible(d)]
"""

_all_distributions = importlib_metadata.distributions  # before any test patches it


class FakeSite:
    """A directory of fake installed distributions (`<name>-<version>.dist-info`) and modules."""

    def __init__(self, path: Path):
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        self.modules: list[str] = []
        self.kept = {"axplug"}  # real distributions still discovered: the core

    def add(
        self,
        name: str,
        entry_points: dict[str, dict[str, str]],
        *,
        version: str = "1.0",
        api: str | None = "1",
        modules: dict[str, str] | None = None,
        first_party: bool = False,
    ) -> None:
        """Install distribution `name`: groups -> {entry name: value}, plus module sources.

        `api` is the plugin API it declares in `axplug.plugin_api` (None: declares none);
        `first_party` adds the `first-party` entry there.
        """
        dist_info = self.path / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA fake plugin.\n"
        (dist_info / "METADATA").write_text(metadata)
        groups = dict(entry_points)
        if api is not None:
            groups["axplug.plugin_api"] = {api: name.replace("-", "_")}
        if first_party:
            groups.setdefault("axplug.plugin_api", {})["first-party"] = name.replace("-", "_")
        lines = []
        for group, entries in groups.items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in entries.items()]
            lines.append("")
        (dist_info / "entry_points.txt").write_text("\n".join(lines))
        for module, source in (modules or {}).items():
            (self.path / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)

    def distributions(self, **kwargs):
        """The installed distributions minus every other axplug plugin: the core, non-plugin
        packages and this site's fakes."""
        return [d for d in _all_distributions(**kwargs) if self._visible(d)]

    def keep_installed(self, *names: str) -> None:
        """Let these real installed distributions stay visible (in this process)."""
        self.kept.update(map(normalize, names))

    def _visible(self, dist) -> bool:
        path = Path(str(getattr(dist, "_path", "")))
        if self.path in path.parents or distribution_key(dist) in self.kept:
            return True
        return "axplug." not in (dist.read_text("entry_points.txt") or "")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess that sees the core and these distributions only."""
        (self.path / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(site=str(self.path)))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AXPLUG_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.path), env.get("PYTHONPATH")]))
        env.update(extra)
        return env

    def forget_modules(self) -> None:
        """Unimport the fake modules so the next test imports its own files."""
        for module in self.modules:
            sys.modules.pop(module, None)

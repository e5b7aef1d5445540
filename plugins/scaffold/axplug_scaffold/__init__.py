"""axplug-scaffold: `axplug new-plugin NAME`, a plugin package written from templates (a
working component of any kind, its pyproject.toml, README and conformance-kit tests)."""

__version__ = "0.1.0"

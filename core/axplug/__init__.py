"""axplug: a modular, plugin-based JAX framework for training and serving large models."""

__version__ = "0.1.6"
# Major.minor of the plugin API (docs/plugin-reference.md); loading checks the major only.
PLUGIN_API_VERSION = "1.11"

__all__ = ["__version__", "PLUGIN_API_VERSION"]


def __getattr__(name: str):
    # Lazy so that `import axplug` (and `axplug list`) does not pay for importing pluggy.
    if name == "hookimpl":
        from axplug.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'axplug' has no attribute {name!r}")

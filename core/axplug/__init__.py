"""axplug: a modular, plugin-based JAX framework for training and serving large models."""

__version__ = "0.1.6"
# Major.minor of the plugin API (docs/plugin-reference.md); loading checks the major only.
PLUGIN_API_VERSION = "1.18"

__all__ = ["__version__", "PLUGIN_API_VERSION"]

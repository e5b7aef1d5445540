"""axplug: a modular, plugin-based JAX framework for training and serving large models."""

__version__ = "0.1.0"
PLUGIN_API_VERSION = "1"

__all__ = ["__version__", "PLUGIN_API_VERSION"]

"""The registry face of the plugin API: what is installed, and loading it by name."""

from axplug import registry as _registry
from axplug.registry import *  # noqa: F403

__all__ = [*_registry.__all__]

"""The layers face of the plugin API: the core layers, and `functional` to call any layer."""

from axplug import layers as _layers
from axplug.layers import *  # noqa: F403

__all__ = [*_layers.__all__]

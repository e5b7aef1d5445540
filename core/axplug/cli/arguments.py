"""Moved to `axplug.api` (plugin API 1.4); this path goes with plugin API 2."""

from axplug.api.moved import moved_names

__getattr__ = moved_names(__name__, {"add_checkpoint_arguments": "axplug.api"})

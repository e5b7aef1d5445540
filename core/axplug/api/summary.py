"""The summary face of the plugin API: summary writers and the metrics files they read and write."""

from axplug import summary as _summary
from axplug.summary import *  # noqa: F403

__all__ = [*_summary.__all__]

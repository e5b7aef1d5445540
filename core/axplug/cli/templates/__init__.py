"""File templates that `axplug new-plugin` fills in (string.Template, `$name` placeholders)."""

from axplug.cli.templates._common import COMMON
from axplug.cli.templates._files import KIND_FILES

__all__ = ["COMMON", "KIND_FILES"]

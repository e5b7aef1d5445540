"""File templates that `axplug new-plugin` fills in (string.Template, `$name` placeholders)."""

from axplug.cli.templates._files import COMMON, KIND_FILES

__all__ = ["COMMON", "KIND_FILES"]

"""The `axplug` command line."""

from axplug.cli.main import main

__all__ = ["main"]

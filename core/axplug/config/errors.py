"""The config errors: one `AxplugError` subclass per kind of mistake, each a standard
exception too (an unknown field is an AttributeError), and how a value is shown in one."""

from __future__ import annotations

import reprlib
from typing import Any

from axplug.api._errors import AxplugError

__all__ = [
    "ConfigError",
    "UnknownFieldError",
    "ConfigTypeError",
    "RequiredFieldError",
    "ConfigValueError",
    "ConfigFileError",
    "ConfigDependencyError",
    "UsageError",
    "shown",
]

# A value in an error message: a few hundred characters at most, whatever its size.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel = 200, 200, 2
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 6


def shown(value: Any) -> str:
    """`repr(value)` cut to a few hundred characters (a huge nested value is never expanded)."""
    return _SHOWN.repr(value)


class ConfigError(AxplugError):
    """Base class of config errors; the message starts with the dotted path."""

    exit_code = 2  # a mistake in what was asked


class UnknownFieldError(ConfigError, AttributeError):
    """A field name that the config class does not define."""


class ConfigTypeError(ConfigError, TypeError):
    """A field value of the wrong type."""


class RequiredFieldError(ConfigError, ValueError):
    """A REQUIRED field still unset at instantiation."""


class ConfigValueError(ConfigError, ValueError):
    """A field value out of its range or set."""


class ConfigFileError(ConfigError, FileNotFoundError):
    """A field naming a file that does not exist."""


class ConfigDependencyError(ConfigError, ImportError):
    """A setting that needs a package that is not installed; the message says what to install."""


class UsageError(ConfigError, ValueError):
    """A command-line option or argument that cannot work; the message starts with it."""

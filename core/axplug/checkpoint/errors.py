"""Errors raised by the checkpointer and by storage lookup."""

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "StorageNotFoundError",
    "StoreOutageError",
]


from axplug.api._errors import AxplugError
from axplug.runtime.exit_codes import RESTART_EXIT_CODE


class CheckpointError(AxplugError):
    """Base class of checkpoint errors; the message names the directory or step."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint (or not the requested step) in the directory."""


class CheckpointCorruptError(CheckpointError):
    """A complete step whose files no longer hold what was saved (or cannot be read)."""


class StorageNotFoundError(CheckpointError, LookupError):
    """No storage backend is installed for a URL scheme."""

    exit_code = 2


class StoreOutageError(CheckpointError, ConnectionError):
    """The store did not answer for its whole outage budget: exit 75, restart the run."""

    exit_code = RESTART_EXIT_CODE

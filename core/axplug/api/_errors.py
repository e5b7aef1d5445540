"""The root of every error axplug and its plugins raise on purpose."""

__all__ = ["AxplugError"]


class AxplugError(Exception):
    """An error whose message is for the user: the `axplug` command prints it as one `error:`
    line and exits with `exit_code` (2: a mistake in what was asked, 1: a run that failed).
    `exit_code = None` marks a programming error, shown with its traceback."""

    exit_code: int | None = 1

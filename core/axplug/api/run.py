"""The run face of the plugin API: the Trainer, the inference Engine, optimizers, run control."""

from typing import TYPE_CHECKING

from axplug.api._face import face

if TYPE_CHECKING:  # the names, for type checkers; at run time each is read on first use
    from axplug.inference import *  # noqa: F403
    from axplug.optim import *  # noqa: F403
    from axplug.runtime import HANG_EXIT_CODE as HANG_EXIT_CODE
    from axplug.runtime import RESTART_EXIT_CODE as RESTART_EXIT_CODE
    from axplug.runtime import DistributedSpec as DistributedSpec
    from axplug.runtime import Preempted as Preempted
    from axplug.runtime import RunDirLockedError as RunDirLockedError
    from axplug.runtime import StoreLease as StoreLease
    from axplug.runtime import resolve_distributed as resolve_distributed
    from axplug.trainer import *  # noqa: F403

_RUN_CONTROL: tuple[str, ...] = ("HANG_EXIT_CODE", "RESTART_EXIT_CODE", "DistributedSpec")
_RUN_CONTROL += ("Preempted", "RunDirLockedError", "StoreLease", "resolve_distributed")

__getattr__ = face(
    __name__, "axplug.inference", "axplug.trainer", "axplug.optim", ("axplug.runtime", _RUN_CONTROL)
)

"""The run face of the plugin API: the Trainer, the inference Engine, optimizers, run control."""

from axplug import inference as _inference
from axplug import optim as _optim
from axplug import trainer as _trainer
from axplug.inference import *  # noqa: F403
from axplug.optim import *  # noqa: F403
from axplug.runtime import (
    HANG_EXIT_CODE,
    RESTART_EXIT_CODE,
    DistributedSpec,
    RunDirLockedError,
    StoreLease,
    resolve_distributed,
)
from axplug.trainer import *  # noqa: F403

__all__: list[str] = ["HANG_EXIT_CODE", "RESTART_EXIT_CODE", "DistributedSpec"]
__all__ += ["RunDirLockedError", "StoreLease", "resolve_distributed"]
__all__ += _inference.__all__
__all__ += _optim.__all__
__all__ += _trainer.__all__

"""More optimizers and learning-rate schedules for axplug: `axplug.optimizers` entries
`adafactor`, `lion`, `muon`, `lamb` and `axplug.schedules` entries `wsd`, `inverse_sqrt`,
`cosine_restarts` (the contracts are `axplug.api.run.OptimizerFactory`, `ScheduleFactory`)."""

from axplug_optimizers.optimizers import MUON_OPTAX, adafactor, lamb, lion, muon
from axplug_optimizers.schedules import cosine_restarts, inverse_sqrt, wsd

__all__ = [
    "adafactor",
    "lion",
    "muon",
    "lamb",
    "MUON_OPTAX",
    "wsd",
    "inverse_sqrt",
    "cosine_restarts",
]

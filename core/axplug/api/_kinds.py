"""The declared type of each plugin entry-point kind that has no base class of its own.

`registry.load` checks what an entry point loads against its kind (axplug.registry._kinds),
as pluggy checks a hook implementation when it is registered: an object that is not what its
kind declares is a broken component (failure `kind`) whose reason says what is missing, never
a crash later. Kinds with a base class are checked against it: `layers` (BaseLayer),
`modifiers` (ConfigModifier), `inputs` (Input), `storage` (Storage), `summary_writers`
(SummaryWriter), `presets` (Preset). The others are declared here. Standard library only, so
checking costs no import.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

__all__ = ["CommandModule", "MeshRuleFactory", "Reward", "RunInfo"]


class CommandModule(Protocol):
    """An `axplug.commands` entry: the module of one `axplug NAME` command.

    Its module docstring's first sentence is the command's line in `axplug --help`. The module
    imports nothing heavy at module level, so `axplug --help` stays fast.
    """

    def add_parser(self, subparsers: Any) -> Any:
        """Adds the command (named as the entry) to `subparsers`, with `run(args) -> int` set
        as its default (`parser.set_defaults(run=run)`); `run` raises, the CLI reports."""


class MeshRuleFactory(Protocol):
    """An `axplug.mesh_rules` entry: a function of no arguments returning a `MeshRule.Config`."""

    def __call__(self) -> Any: ...


class Reward(Protocol):
    """An `axplug.rewards` entry: a class built with its options as keyword arguments, scoring
    generated completions against their prompt records (a plugin may give a base class)."""

    def score(self, completion: str, sample: dict) -> float: ...

    def score_batch(self, completions: list[str], samples: list[dict]) -> list[float]: ...


class RunInfo(NamedTuple):
    """What the trainer fills into a summary writer's config: each writer config field of one
    of these names that is unset (None or REQUIRED) gets the run's value (see
    `SummaryWriter.fill_run_fields`)."""

    dir: str  # the run's local summary directory
    max_steps: int
    every_n_steps: int  # the trainer's log_every
    tokens_per_step: int | None

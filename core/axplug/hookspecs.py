"""Trainer lifecycle hooks; plugins implement them with `@hookimpl` under `axplug.hooks`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from axplug.trainer import Trainer

__all__ = [
    "PROJECT",
    "hookspec",
    "hookimpl",
    "on_train_start",
    "on_step_end",
    "on_eval_end",
    "on_checkpoint_saved",
    "on_train_end",
    "on_hang",
    "on_slow_step",
    "on_low_utilization",
    "device_utilization",
]

PROJECT = "axplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def on_train_start(trainer: Trainer) -> None:
    """Called once before the first step, after the state is initialized or restored."""


@hookspec
def on_step_end(trainer: Trainer, step: int, metrics: dict) -> None:
    """Called after every train step with that step's metrics."""


@hookspec
def on_eval_end(trainer: Trainer, step: int, metrics: dict) -> None:
    """Called after an evaluation run with its metrics."""


@hookspec
def on_checkpoint_saved(trainer: Trainer, step: int, path: str) -> None:
    """Called once the checkpoint of `step` is complete at `path`."""


@hookspec
def on_train_end(trainer: Trainer, metrics: dict) -> None:
    """Called once after the last step with the final metrics."""


@hookspec
def on_hang(trainer: Trainer, step: int | None, seconds: float, report: str) -> None:
    """Called from the watchdog thread when no step completed for `seconds` after `step`."""


@hookspec
def on_slow_step(trainer: Trainer, step: int, seconds: float, median: float) -> None:
    """Called when `step` took `seconds`, more than watchdog.slow_step_factor x `median`."""


@hookspec
def on_low_utilization(
    trainer: Trainer, step: int, metric: str, value: float, threshold: float
) -> None:
    """Called when `metric` ("mfu" or "device_busy", a percentage) over the watchdog's last
    utilization_window steps up to `step` was `value`, below the configured `threshold`."""


@hookspec(firstresult=True)
def device_utilization(devices: list) -> float | None:
    """The mean busy percentage (0-100) of the local `devices` now, or None if this plugin
    cannot read them (another kind of device, no driver library)."""

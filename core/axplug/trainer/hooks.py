"""Calls pluggy trainer hooks one implementation at a time, so one failing plugin is contained."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axplug.trainer.trainer import Trainer

__all__ = ["HookRunner", "hooked_watchdog"]

log = logging.getLogger("axplug.trainer")


class HookRunner:
    """Runs every implementation of a hook; one that raises is reported and, for the rest of
    the run, not called again."""

    def __init__(self, plugin_manager: Any):
        self._pm = plugin_manager
        self.failures: list[str] = []
        self._dropped: set[tuple[str, str]] = set()  # (hook, plugin) that raised

    def __call__(self, hook: str, **kwargs: Any) -> None:
        for _ in self._results(hook, kwargs):
            pass

    def first(self, hook: str, **kwargs: Any) -> Any:
        """The first non-None result of `hook`'s implementations (a query hook), or None."""
        return next((r for r in self._results(hook, kwargs) if r is not None), None)

    def _results(self, hook: str, kwargs: dict):
        caller = getattr(self._pm.hook, hook)
        for impl in reversed(caller.get_hookimpls()):  # pluggy's own order: last registered first
            if (hook, impl.plugin_name) in self._dropped:
                continue
            try:
                yield impl.function(*(kwargs[name] for name in impl.argnames))
            except Exception as exc:  # noqa: BLE001 - a plugin must not kill the run
                self._dropped.add((hook, impl.plugin_name))
                message = (
                    f"hook {hook} of plugin {impl.plugin_name} raised "
                    f"{type(exc).__name__}: {exc}; the run continues without it"
                )
                log.warning(message)
                self.failures.append(message)


def hooked_watchdog(watchdog_cfg: Any, trainer: Trainer) -> Any:
    """The run's watchdog, reporting hangs, slow steps and low utilization to the hooks and
    reading device busy time from them."""
    return watchdog_cfg.instantiate(
        on_hang=lambda step, seconds, report: trainer.hooks(
            "on_hang", trainer=trainer, step=step, seconds=seconds, report=report
        ),
        on_slow_step=lambda step, seconds, median: trainer.hooks(
            "on_slow_step", trainer=trainer, step=step, seconds=seconds, median=median
        ),
        on_low_utilization=lambda step, metric, value, threshold: trainer.hooks(
            "on_low_utilization",
            trainer=trainer,
            step=step,
            metric=metric,
            value=value,
            threshold=threshold,
        ),
        read_device_busy=lambda: trainer.hooks.first(
            "device_utilization", devices=trainer.local_devices()
        ),
    )

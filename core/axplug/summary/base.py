"""The summary writer interface and a writer that fans out to several."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from axplug.api._kinds import RunInfo
from axplug.config import REQUIRED, Configurable, config_class

__all__ = ["SummaryWriter", "CompositeWriter", "to_scalars", "group_tag", "is_eval_name"]


def to_scalars(scalars: Mapping[str, Any]) -> dict[str, float]:
    """Plain Python floats from numbers, numpy scalars or 0-d jax arrays (one device fetch each)."""
    out = {}
    for name, value in scalars.items():
        try:
            out[name] = float(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"summary {name!r}: expected a scalar, got {type(value).__name__} ({value!r:.80})"
            ) from e
    return out


def is_eval_name(name: str) -> bool:
    """Whether a metric comes from an evaluation: `eval_loss`, `eval_<x>`, or an evaluator's
    `eval/<task>/<metric>`."""
    return name.startswith(("eval_", "eval/"))


def group_tag(name: str) -> str:
    """The dashboard tag of a metric: names with a group keep it (`goodput/wall_s`,
    `router/dropped_fraction`), `eval_loss` -> `eval/loss`, the rest -> `train/<name>`."""
    if "/" in name:
        return name
    if name.startswith("eval_"):
        return "eval/" + name[len("eval_") :]
    return "train/" + name


def format_scalar(value: float) -> str:
    """A short human-readable number: 4 significant digits, k/M/G above 10,000."""
    if not math.isfinite(value):
        return str(value)
    for threshold, scale, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:.4g}"


class SummaryWriter(Configurable, abc.ABC):
    """Receives scalars once per logged step; also a context manager that closes itself.

    The trainer fills the config fields named in `RUN_FIELDS` (the fields of
    `axplug.api._kinds.RunInfo`: `dir`, `max_steps`, `every_n_steps`, `tokens_per_step`) that a
    writer's config declares and leaves unset (None or REQUIRED); see `fill_run_fields`.
    """

    RUN_FIELDS: ClassVar[tuple[str, ...]] = RunInfo._fields
    # True: written every step (a progress display), not every `log_every` steps.
    every_step: ClassVar[bool] = False

    @classmethod
    def fill_run_fields(cls, cfg: Configurable.Config, run: RunInfo) -> Configurable.Config:
        """A copy of the writer config `cfg` with each unset field named in `RUN_FIELDS` set
        from `run`; fields it does not declare are left alone."""
        cfg = cfg.clone()
        declared = set(cfg.keys())
        for name in cls.RUN_FIELDS:
            value = getattr(cfg, name) if name in declared else 0
            if value is None or value is REQUIRED:
                setattr(cfg, name, getattr(run, name))
        return cfg

    @abc.abstractmethod
    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records `scalars` (name -> number) at `step`."""

    def write_run_summary(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records a run's closing figures (its goodput) at its last step; by default as one
        more `write`. Writers whose records hold one line per step override it."""
        self.write(step, scalars)

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:  # noqa: B027
        """Records the distribution of each array at `step`; writers that can show one
        override this (the default drops them: their mean and max are also scalars)."""

    def truncate(self, step: int) -> None:  # noqa: B027 - optional for writers without files
        """Drops what was written for steps >= `step`: a resumed run logs them again."""

    def flush(self) -> None:  # noqa: B027 - optional for writers that do not buffer
        """Pushes anything buffered to its destination."""

    def close(self) -> None:
        """Flushes and releases files or terminals; the writer is not used afterwards."""
        self.flush()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class CompositeWriter(SummaryWriter):
    """Sends every call to each of `writers`, in order.

    `close` closes every writer even when one fails, then raises the first failure.
    """

    @config_class
    class Config(SummaryWriter.Config):
        writers: list = []  # configs of SummaryWriter subclasses

    def __init__(self, cfg: Config, *, writers: list[SummaryWriter] | tuple = ()):
        super().__init__(cfg)
        built = [w.instantiate() for w in cfg.writers]
        self.writers: list[SummaryWriter] = built + list(writers)

    @classmethod
    def of(cls, *writers: SummaryWriter) -> CompositeWriter:
        """A composite of writers that are already built."""
        return cls(cls.default_config(), writers=writers)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.write(step, scalars)

    def write_run_summary(self, step: int, scalars: Mapping[str, float]) -> None:
        for w in self.writers:
            w.write_run_summary(step, scalars)

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write_histograms(step, arrays)

    def truncate(self, step: int) -> None:
        for w in self.writers:
            w.truncate(step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        first: BaseException | None = None
        for w in self.writers:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001 - close the rest, then raise
                first = first or e
        if first is not None:
            raise first

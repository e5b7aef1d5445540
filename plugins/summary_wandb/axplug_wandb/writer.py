"""`WandbWriter`: an axplug run's metrics as one Weights & Biases run."""

from __future__ import annotations

import os
import pathlib
import secrets
from collections.abc import Mapping
from typing import Any

from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.summary import SummaryWriter, group_tag, to_scalars

__all__ = ["WandbWriter"]

_MODES = (None, "online", "offline", "disabled")
# The W&B run id of an axplug run, kept in the run directory: a resumed run continues it.
RUN_ID_FILE = "wandb-run-id"


class WandbWriter(SummaryWriter):
    """Logs scalars (tagged `train/`, `eval/`, `goodput/`, `moe/`...) and histograms to a W&B
    run whose files live in `dir/wandb/`.

    The run id is kept in `dir/wandb-run-id`, so resuming the axplug run resumes the W&B run.
    W&B steps only grow: after a resume from an earlier checkpoint the replayed steps keep
    their first values (W&B would drop them with a warning each; this writer skips them).
    `mode=None` leaves it to W&B (`WANDB_MODE`, then online if logged in); `offline` writes
    files that `wandb sync DIR/wandb/offline-run-*` uploads later.
    """

    @config_class
    class Config(SummaryWriter.Config):
        dir: Required[str] = REQUIRED
        project: str | None = None  # None: WANDB_PROJECT, else "axplug"
        entity: str | None = None
        name: str | None = None  # None: the run directory's name
        group: str | None = None
        tags: list[str] = []
        mode: str | None = None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.mode not in _MODES:
            raise cfg.field_error("mode", f"must be one of {_MODES}, got {cfg.mode!r}")
        import wandb  # imported here: listing or configuring the writer stays cheap

        run_dir = pathlib.Path(cfg.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.run: Any = wandb.init(
            dir=str(run_dir),
            id=_run_id(run_dir),
            resume="allow",
            project=cfg.project or os.environ.get("WANDB_PROJECT") or "axplug",
            entity=cfg.entity,
            name=cfg.name or run_dir.resolve().name,
            group=cfg.group,
            tags=list(cfg.tags) or None,
            mode=cfg.mode,  # type: ignore[arg-type]  # one of _MODES (check_config)
            settings=wandb.Settings(console="off", silent=True),
        )
        self._last_step = self.run.step - 1 if self.run.step else -1

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._log(step, {group_tag(k): v for k, v in to_scalars(scalars).items()})

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        import numpy as np

        histogram = self._wandb.Histogram  # takes arrays, though typed for sequences
        data = {group_tag(k): histogram(np.asarray(v)) for k, v in arrays.items()}  # type: ignore[arg-type]
        self._log(step, data)

    def _log(self, step: int, data: dict) -> None:
        step = int(step)
        if step < self._last_step or not data:
            return  # a step the W&B run already has: resumed from an earlier checkpoint
        self._last_step = step
        self.run.log(data, step=step)

    def close(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def __exit__(self, *exc_info: object) -> None:
        self.close(1 if exc_info[0] is not None else 0)


def _run_id(run_dir: pathlib.Path) -> str:
    path = run_dir / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return run_id

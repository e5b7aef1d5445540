"""`TensorBoardWriter`: event files under `DIR/tensorboard/`, written with tensorboardX."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Mapping
from typing import Any

from axplug.api.config import REQUIRED, Required, config_class
from axplug.api.summary import SummaryWriter, group_tag, to_scalars

__all__ = ["TensorBoardWriter"]


def _import_tensorboardx():
    """tensorboardX, imported without torch: its writer imports torch (2.2 s here) only to
    recognize torch tensors, and this writer hands it floats and numpy arrays. Imported on
    use, so listing or configuring the writer stays cheap."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        # An ImportError for tensorboardX's `try: import torch`.
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]  # a later `import torch` works as usual
    return tensorboardX


class TensorBoardWriter(SummaryWriter):
    """One scalar summary per name and step, tagged by group (`train/loss`, `eval/loss`,
    `goodput/...`, `moe/...`), and histograms of array summaries (`moe/expert_load`).

    A resumed run writes a new event file beside the old ones; the trainer calls
    `truncate(step)` with the first step it will log again, which starts that file with a
    purge at `step`, so TensorBoard hides the old run's events from that step on instead of
    showing the replayed steps twice. `purge_step` does the same from the start.
    """

    @config_class
    class Config(SummaryWriter.Config):
        dir: Required[str] = REQUIRED
        subdir: str = "tensorboard"
        flush_secs: int = 30
        purge_step: int | None = None

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        tensorboardX = _import_tensorboardx()

        # A NaN loss is logged as NaN on purpose; tensorboardX would warn on the root logger.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

        self.logdir = pathlib.Path(cfg.dir) / cfg.subdir
        self._open = lambda purge_step: tensorboardX.SummaryWriter(
            logdir=str(self.logdir), flush_secs=cfg.flush_secs, purge_step=purge_step
        )
        # The event file opens on the first write, so a purge can still start it (an empty file
        # opened here would stay beside the purged one when the clock's second turns between).
        self._purge_step, self._writer = cfg.purge_step, None

    def truncate(self, step: int) -> None:
        """Hides events at or after `step` from earlier runs (a purge where the file starts)."""
        if step > 1 and self._writer is None:
            self._purge_step = step

    def _file(self):
        if self._writer is None:
            self._writer = self._open(self._purge_step)
        return self._writer

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in to_scalars(scalars).items():
            self._file().add_scalar(group_tag(name), value, global_step=int(step))

    def write_histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        import numpy as np

        for name, value in arrays.items():
            self._file().add_histogram(group_tag(name), np.asarray(value), global_step=int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

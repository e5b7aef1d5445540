"""Bookkeeping of the training loop: the non-finite step guard and throughput timing."""

from __future__ import annotations

import logging
import time
from typing import Any

from axplug.api._errors import AxplugError
from axplug.config import ConfigBase, config_class
from axplug.input import batch_shape

__all__ = ["NonFiniteError", "NonFiniteGuard", "StepTimer", "tokens_per_step"]

log = logging.getLogger("axplug.trainer")


class NonFiniteError(AxplugError, RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Counts consecutive non-finite steps (which the step already left unapplied)."""

    @config_class
    class Config(ConfigBase):
        # Consecutive steps with a non-finite loss or gradient before the run stops.
        max_steps: int = 3
        # How a non-finite step is left unapplied: "cond" (a branch), "select" (an
        # elementwise select fused into the update), or "auto": cond on CPU, select on
        # accelerators (where a branch copies the state). Same results either way.
        mode: str = "auto"

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped: list[int] = []

    def update(self, step: int, finite: bool, loss: float | None) -> None:
        if finite:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.skipped.append(step)
        log.warning(
            "step %d: non-finite loss or gradient (loss=%s); update skipped (%d/%d consecutive)",
            step,
            loss,
            self.consecutive,
            self.max_consecutive,
        )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"stopping at step {step}: {self.consecutive} consecutive steps had a non-finite "
                f"loss or gradient (skipped steps: {self.skipped[-self.consecutive :]}); no update "
                "from them was applied, so the last checkpoint is finite. Lower the learning "
                "rate, check the input data, or raise guard.max_steps."
            )


def tokens_per_step(input_cfg: Any) -> int:
    """Tokens in a global batch of an input config (0 when it has no batch_size/seq_len)."""
    batch, seq = batch_shape(input_cfg) or (0, 0)
    return batch * seq


class StepTimer:
    """Step time, tokens per second and, given the model's FLOPs per step and the devices'
    total peak FLOP/s, model FLOP/s and MFU between consecutive logged steps."""

    def __init__(
        self, tokens_per_step: int, flops_per_step: float = 0.0, peak_flops: float | None = None
    ):
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self._last: tuple[int, float] | None = None

    @classmethod
    def for_run(cls, trainer_cfg: Any, model: Any, mesh: Any) -> StepTimer:
        """The timer of a run: its tokens and model FLOPs per step, and the mesh's total peak
        FLOP/s (`peak_flops_per_device`, else the detected accelerator's spec; None on CPU)."""
        from axplug.mesh_rules import detected_device_spec
        from axplug.trainer.flops import model_flops_per_step

        try:
            flops = model_flops_per_step(trainer_cfg, model)
        except (AttributeError, TypeError):  # an input without batch_size / seq_len
            flops = 0.0
        per_device = trainer_cfg.peak_flops_per_device
        if per_device is None:
            spec = detected_device_spec(list(mesh.devices.flat))
            per_device = spec.peak_bf16_flops if spec else None
        peak = per_device * mesh.devices.size if per_device else None
        return cls(tokens_per_step(trainer_cfg.input), flops, peak)

    def mfu(self, seconds: float) -> float | None:
        """Model FLOPs utilization of one step that took `seconds`; None without a peak."""
        if self.flops_per_step and self.peak_flops and seconds > 0:
            return self.flops_per_step / (seconds * self.peak_flops)
        return None

    def tick(self, step: int, busy: float | None = None) -> dict[str, float]:
        """Rates of the steps since the last tick: over `busy` seconds when given (the
        loop's time without evaluations and checkpoints), else the wall time between ticks."""
        now = time.perf_counter()
        out: dict[str, float] = {}
        if self._last is not None and step > self._last[0]:
            elapsed = now - self._last[1] if busy is None else busy
            seconds = elapsed / (step - self._last[0])
            out = {"step_time": seconds}
            if self.tokens_per_step:
                out["tokens_per_sec"] = self.tokens_per_step / seconds
            if self.flops_per_step:
                out["model_flops_per_sec"] = self.flops_per_step / seconds
            if (mfu := self.mfu(seconds)) is not None:
                out["mfu"] = mfu
        self._last = (step, now)
        return out

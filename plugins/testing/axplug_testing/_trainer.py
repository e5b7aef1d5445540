"""The tiny trainer tests run: a preset shrunk to train in about a second on CPU."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axplug.config import ConfigBase
    from axplug.trainer import Trainer

__all__ = ["tiny_trainer_config", "tiny_train_args", "train_steps"]

# Applied before a test's own overrides, which may change any of them. Two layers: a program's
# trace, lowering and compile grow with its unrolled layers (a four-layer preset cost the
# suite 7% more CPU time). No compilation cache of the run's own: the process's settings apply
# (under pytest, the session's cache; see axplug_testing.pytest_plugin), never
# ~/.cache/axplug/xla.
_TINY = (
    "compilation_cache_dir=None",
    "model.decoder.dim=32",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.feed_forward.hidden_dim=64",
    "input.seq_len=32",
    "input.batch_size=8",
)
# One device: a tiny step over 8 fake CPU devices compiles and runs about twice as long, and
# saves slices of every array. A modifier, applied before the test's own: a later `mesh:...`
# modifier or `mesh.*` override lays out the test's mesh instead.
_ONE_DEVICE = "mesh"


def tiny_trainer_config(
    output_dir: str | os.PathLike[str],
    *overrides: str,
    preset: str = "gpt-tiny",
    modifiers: Sequence[str] = (),
    max_steps: int = 2,
    summary_writers: Sequence[ConfigBase] = (),
) -> Trainer.Config:
    """`preset` on one device (the `mesh` modifier, before `modifiers`: a `mesh:...` of theirs
    or a `mesh.*` override lays out another mesh), shrunk (2 layers, dim 32, feed-forward 64,
    8 rows of 32 tokens), the process's compilation cache, writing to `output_dir`; then `overrides`
    (`path=value`, as `--set`).

    `summary_writers` replaces the trainer's writers (none by default: nothing to read back
    costs nothing), e.g. `[JsonlWriter.default_config()]` for a test that reads the metrics.
    """
    from axplug.config import apply_overrides
    from axplug.presets import preset_config

    tiny = [f"output_dir={os.fspath(output_dir)!r}", f"max_steps={max_steps}", *_TINY]
    cfg = preset_config(preset, modifiers=[_ONE_DEVICE, *modifiers], overrides=tiny)
    return apply_overrides(cfg.clone(summary_writers=list(summary_writers)), overrides)


def tiny_train_args(
    output_dir: str | os.PathLike[str],
    *overrides: str,
    preset: str = "gpt-tiny",
    modifiers: Sequence[str] = (),
    max_steps: int = 2,
) -> list[str]:
    """The same run as `axplug train` arguments (`main(tiny_train_args(...))`, or after
    `python -m axplug.cli`); the command's own summary writers stay (`metrics.jsonl`, ...)."""
    args = ["train", "--preset", preset, "--output-dir", os.fspath(output_dir)]
    args += ["--max-steps", str(max_steps)]
    for spec in (_ONE_DEVICE, *modifiers):
        args += ["--modifier", spec]
    for spec in (*_TINY, *overrides):
        args += ["--set", spec]
    return args


def train_steps(
    trainer: Trainer, steps: int, state: dict | None = None, compiler_options: dict | None = None
) -> tuple[dict, list]:
    """`steps` calls of the trainer's built train step from `state` (default: a fresh one) on
    its input's first batches, without a run (no checkpoint, writer or hook): (the state, each
    step's metrics, read back). What a test of the step's behaviour needs; `compiler_options`
    compiles the step with them (e.g. `production_compiler_options()`).

    A given `state` (host or device arrays) is copied onto the trainer's layout, as its own:
    the step donates what it gets, and the caller's may start another trainer."""
    import jax

    if state is None:
        state = trainer.init_state()
    else:
        state = jax.device_put(state, trainer.layout.shardings, may_alias=False)
    metrics, batches, step = [], trainer.input.iter_from(0), trainer._train_step
    for _ in range(steps):
        batch = trainer.put_batch(next(batches)[1])
        if compiler_options is not None and step is trainer._train_step:
            step = step.lower(state, batch).compile(compiler_options)
        state, out = step(state, batch)
        metrics.append(jax.device_get(out))
    return state, metrics

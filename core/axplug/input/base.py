"""Abstract inputs: `iter_from(step)`, and step-addressed batches sharded by process rows."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from axplug.config import Configurable, ConfigValueError, config_class, configurable_class

__all__ = [
    "Batch",
    "Input",
    "Policy",
    "StepInput",
    "batch_shape",
    "data_vocab_size",
    "input_class",
    "check_split",
    "check_step",
    "eval_split_of",
]

Batch = dict[str, np.ndarray]


class Policy(NamedTuple):
    """The model being trained, as `Input.before_batch` sees it before each step: its layer,
    the parameters that step starts from (the training arrays themselves) and the mesh."""

    model: Any
    params: Any
    mesh: Any
    axis_rules: Any


def field_error(cfg: Configurable.Config, name: str, problem: str) -> ConfigValueError:
    """A ConfigValueError (a ValueError) whose message starts with the dotted path of `name`."""
    return cfg.field_error(name, problem, ConfigValueError)


def check_step(step: object) -> None:
    """Refuses a step that is not an int >= 0 (a batch is asked for by code, not config)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def check_split(cfg: Configurable.Config) -> None:
    """Validates the `split` and `eval_fraction` fields of an input with a held-out split."""
    if cfg.split not in ("train", "eval"):
        raise field_error(cfg, "split", f"must be 'train' or 'eval', got {cfg.split!r}")
    if not 0.0 < cfg.eval_fraction < 1.0:
        raise field_error(cfg, "eval_fraction", f"must be in (0, 1), got {cfg.eval_fraction}")


def eval_split_of(input_cfg: Configurable.Config) -> Configurable.Config | None:
    """The held-out split of an input config that has one (`Input.eval_split_of`), else None."""
    klass = input_class(input_cfg)
    return klass.eval_split_of(input_cfg) if klass is not None else None


def batch_shape(input_cfg: Any) -> tuple[int, int] | None:
    """(global batch size, sequence length) an input config fixes (`Input.batch_shape_of`)."""
    klass = input_class(input_cfg)
    return klass.batch_shape_of(input_cfg) if klass is not None else None


def input_class(cfg: Any) -> type[Input] | None:
    """The Input subclass `cfg` configures, if it configures one."""
    klass = configurable_class(cfg)
    return klass if klass is not None and issubclass(klass, Input) else None


def data_vocab_size(cfg: Configurable.Config) -> int | None:
    """The token vocabulary an input config's batches draw from, when it is known without
    building the input (`Input.vocab_size_of`), else None."""
    klass = input_class(cfg)
    return klass.vocab_size_of(cfg) if klass is not None else None


class Input(Configurable, abc.ABC):
    """A source of training batches that can restart at any step."""

    vocab_size: int | None = None  # a vocabulary fixed by the class (bytes: 256)

    @classmethod
    def vocab_size_of(cls, cfg: Any) -> int | None:
        """The vocabulary `cfg`'s batches draw from, known without building the input: a
        `vocab_size` field, else the class's (a data directory's input reads its tokenizer)."""
        size = dict(cfg.items()).get("vocab_size")
        return size if isinstance(size, int) else cls.vocab_size

    @classmethod
    def batch_shape_of(cls, cfg: Any) -> tuple[int, int] | None:
        """(global batch size, sequence length) of `cfg`'s batches when the config fixes
        them (`batch_size` and `seq_len` fields, as every StepInput has), else None."""
        fields = dict(cfg.items())
        batch, seq = fields.get("batch_size"), fields.get("seq_len")
        return (batch, seq) if isinstance(batch, int) and isinstance(seq, int) else None

    @classmethod
    def eval_split_of(cls, cfg: Any) -> Configurable.Config | None:
        """The config of `cfg`'s held-out split (a `split` field set to "eval"), else None."""
        return cfg.clone(split="eval") if "split" in dict(cfg.items()) else None

    @classmethod
    def tokenizer_dir_of(cls, cfg: Any) -> str | None:
        """The data directory (or URL) whose tokenizer made `cfg`'s tokens, if any."""
        return None

    @abc.abstractmethod
    def iter_from(self, step: int) -> Iterator[tuple[int, Batch]]:
        """Yields `(step, batch)` for step, step + 1, ... (endless unless the source ends)."""

    def state_at(self, step: int) -> dict | None:
        """The JSON state from which this process's batches continue at `step` (the batches
        of earlier steps consumed); None: batches are a function of the step (the default).

        The trainer saves it with every checkpoint and hands it to `restore_state` on resume.
        """
        return None

    def restore_state(self, step: int, state: dict) -> None:
        """Continues, at the next `iter_from(step)`, from `state_at(step)` of the saved run."""

    def before_batch(self, step: int, policy: Policy) -> None:
        """Called before the batch of `step` is drawn, with the `policy` that step trains: an
        input whose batches the model makes (RL rollouts) reads it; nothing by default."""

    def metrics(self, step: int) -> dict[str, float]:
        """Scalars about the data served before `step` (e.g. tokens per source), logged with
        the step's metrics; {} by default."""
        return {}


class StepInput(Input):
    """Batches that are a pure function of `(seed, step)`: a resumed run sees the same data.

    `batch_size` is the global batch; process `process_index` of `process_count` gets rows
    `[i * b, (i + 1) * b)` with `b = batch_size // process_count`, so the processes' rows,
    concatenated in process order, are exactly the single-process batch.
    """

    @config_class
    class Config(Input.Config):
        seq_len: int = 256
        batch_size: int = 8
        seed: int = 0
        process_index: int = 0
        process_count: int = 1

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.seq_len < 1:
            raise field_error(cfg, "seq_len", f"must be >= 1, got {cfg.seq_len}")
        if cfg.batch_size < 1:
            raise field_error(cfg, "batch_size", f"must be >= 1, got {cfg.batch_size}")
        if cfg.seed < 0:
            raise field_error(cfg, "seed", f"must be >= 0, got {cfg.seed}")
        if cfg.process_count < 1:
            raise field_error(cfg, "process_count", f"must be >= 1, got {cfg.process_count}")
        if not 0 <= cfg.process_index < cfg.process_count:
            raise field_error(
                cfg,
                "process_index",
                f"must be in [0, process_count={cfg.process_count}), got {cfg.process_index}",
            )
        if cfg.batch_size % cfg.process_count:
            raise field_error(
                cfg,
                "batch_size",
                f"{cfg.batch_size} is not divisible by process_count={cfg.process_count}; "
                "each process takes batch_size / process_count rows of the global batch",
            )

    @property
    def local_batch_size(self) -> int:
        """Rows of the global batch that this process produces."""
        return self._config.batch_size // self._config.process_count

    def batch(self, step: int) -> Batch:
        """This process's rows of the global batch at `step`: int32 [local_batch, seq_len]."""
        check_step(step)
        cfg = self._config
        # One generator per (seed, step) draws the whole global batch; each process keeps its
        # rows, so sharding never changes what a row contains.
        rng = np.random.default_rng([cfg.seed, int(step)])
        start = cfg.process_index * self.local_batch_size
        rows = slice(start, start + self.local_batch_size)
        windows = self._windows(rng, rows)  # [local_batch, seq_len + 1]
        return {
            "input_ids": np.ascontiguousarray(windows[:, :-1], dtype=np.int32),
            "target_labels": np.ascontiguousarray(windows[:, 1:], dtype=np.int32),
        }

    def iter_from(self, step: int) -> Iterator[tuple[int, Batch]]:
        while True:
            yield step, self.batch(step)
            step += 1

    @abc.abstractmethod
    def _windows(self, rng: np.random.Generator, rows: slice) -> np.ndarray:
        """Token windows [len(rows), seq_len + 1] for `rows` of the global batch.

        Must draw from `rng` for all `batch_size` rows, whatever `rows` is.
        """

"""What a run evaluates every `eval_every` steps: the eval loss on its eval input (given, or
the training input's eval split) and the scalars of its evaluators."""

from __future__ import annotations

from typing import Any

from axplug.input import eval_split_of
from axplug.runtime import shard_input_config

__all__ = ["build_evaluation"]


def build_evaluation(cfg: Any, rows: Any) -> tuple[Any, list]:
    """(the eval input sharded by `rows` or None, the evaluators) of a trainer config."""
    evaluators = [c.instantiate(_path=f"evaluators[{i}]") for i, c in enumerate(cfg.evaluators)]
    eval_cfg = cfg.eval_input
    if eval_cfg is None and cfg.eval_every is not None:
        eval_cfg = eval_split_of(cfg.input)
        if eval_cfg is None and not evaluators:
            raise cfg.field_error(
                "eval_every",
                f"{cfg.input.klass.__name__} has no eval split; set eval_input to an "
                "input config, or eval_every=None",
            )
    eval_input = None if eval_cfg is None else shard_input_config(eval_cfg, rows).instantiate()
    return eval_input, evaluators

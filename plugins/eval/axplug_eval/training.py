"""lm-eval tasks during training: the `eval_tasks` modifier adds an `LmEvalEvaluator` to the
trainer's evaluators, so downstream scores are logged beside the loss every `eval_every`
steps (metrics.jsonl, TensorBoard, W&B: whatever writers the run has)."""

from __future__ import annotations

import logging
import types
from typing import Any

from axplug.api.config import ConfigBase, ConfigModifier, Configurable, config_class

__all__ = ["EvalTasksModifier", "LmEvalEvaluator"]

log = logging.getLogger("axplug.eval")


class LmEvalEvaluator(Configurable):
    """Runs lm-eval `tasks` ("+"-separated) on the parameters being trained, through a
    continuous-batching Engine on the trainer's mesh; returns `eval/TASK/METRIC` scalars."""

    @config_class
    class Config(Configurable.Config):
        tasks: str = ""
        limit: float | None = 32  # documents per task: a few, to keep training moving
        include_path: str | None = None  # a directory of task YAML files
        num_fewshot: int | None = None
        num_slots: int = 8
        speculative: str | None = None  # a proposer spec (`ngram`): Engine(speculative=)
        max_len: int | None = None  # context (default: the input's seq_len)
        max_gen_toks: int = 32
        seed: int = 1234

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """The ConfigError a run would raise, before it starts (`axplug train` checks first)."""
        if not [t for t in cfg.tasks.split("+") if t]:
            raise cfg.field_error("tasks", "name at least one lm-eval task, e.g. tasks=hellaswag")
        if cfg.limit is not None and cfg.limit <= 0:
            raise cfg.field_error("limit", f"must be > 0 or None, got {cfg.limit}")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.check_config(cfg)
        self.task_names = [t for t in cfg.tasks.split("+") if t]

    def __call__(self, trainer: Any, params: Any, step: int) -> dict[str, float]:
        from axplug.api.run import Engine, LoadedModel, find_tokenizer
        from axplug_eval.command import evaluate, metrics
        from axplug_eval.lm import EngineLM

        cfg, run = self.config, trainer.config
        loaded = LoadedModel(model=trainer.model, params=params, config=run, step=step)
        tokenizer = find_tokenizer(loaded, run.restore.init_from or run.output_dir)
        seq_len = getattr(run.input, "seq_len", None)
        max_len = cfg.max_len or (seq_len if isinstance(seq_len, int) and seq_len > 1 else 2048)
        engine = Engine(trainer.model, params, num_slots=cfg.num_slots, max_len=max_len,
                        mesh=trainer.mesh, axis_rules=trainer.mesh_builder.axis_rules,
                        speculative=cfg.speculative)  # fmt: skip
        eos = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        lm = EngineLM(engine, tokenizer, stop_tokens=eos, batch_size=64,
                      max_gen_toks=min(cfg.max_gen_toks, max_len // 2))  # fmt: skip
        args = types.SimpleNamespace(
            tasks=self.task_names, include_path=[cfg.include_path] if cfg.include_path else [],
            limit=cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=64, seed=cfg.seed,
        )  # fmt: skip
        scalars = metrics(evaluate(lm, args))
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
        return scalars


class EvalTasksModifier(ConfigModifier):
    """`eval_tasks:tasks=hellaswag+arc_easy,limit=32,every=500`: lm-eval tasks every `every`
    steps of training (the trainer's eval_every, if it has none yet), logged as
    `eval/TASK/METRIC` beside the loss."""

    positional_option = "tasks"

    @config_class
    class Config(ConfigModifier.Config):
        tasks: str = ""
        limit: float | None = 32
        include_path: str | None = None
        num_fewshot: int | None = None
        max_gen_toks: int = 32
        every: int | None = None

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self._config
        if not hasattr(cfg, "evaluators"):
            raise cfg.field_error("evaluators", "eval_tasks modifies a trainer config")
        evaluator = LmEvalEvaluator.default_config().set(
            tasks=c.tasks, limit=c.limit, include_path=c.include_path,
            num_fewshot=c.num_fewshot, max_gen_toks=c.max_gen_toks,
        )  # fmt: skip
        every = c.every or cfg.eval_every or max(1, cfg.checkpoint_every)
        return cfg.clone(evaluators=[*cfg.evaluators, evaluator], eval_every=every)

"""The Trainer: builds model, learner, mesh, input and checkpointer from one config and runs."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from axplug import registry
from axplug.checkpoint import Checkpointer
from axplug.config import REQUIRED, Configurable, InstantiableConfig, Required, config_class
from axplug.input import ByteTextInput, Policy
from axplug.learner import Learner
from axplug.mesh import MeshBuilder, batch_partition_spec, parameter_shardings
from axplug.runtime import (
    GoodputRecorder,
    Preempted,
    RunDirLock,
    StopAgreement,
    StopSignals,
    Watchdog,
    put_process_batch,
    shard_input_config,
)
from axplug.sharding import make_scope
from axplug.summary import JsonlWriter, ProgressBar
from axplug.trainer.attempts import AttemptRecorder
from axplug.trainer.aux_losses import AuxLossRule
from axplug.trainer.compilation import DEFAULT_CACHE_DIR, compile_ahead
from axplug.trainer.config_checks import check_trainer_config
from axplug.trainer.evaluation import build_evaluation
from axplug.trainer.hooks import HookRunner, hooked_watchdog
from axplug.trainer.input_state import restore_input_state
from axplug.trainer.layout import StateLayout, check_input_split
from axplug.trainer.loop_state import NonFiniteGuard, StepTimer, tokens_per_step
from axplug.trainer.profiling import StepProfiler
from axplug.trainer.restore import Restorer
from axplug.trainer.saving import Saver
from axplug.trainer.step import build_train_step, guard_for, jit_steps
from axplug.trainer.summaries import attempt_recorder, build_writer, goodput_report, summary_dir
from axplug.trainer.trainable import frozen_masks, pick, update_kinds

__all__ = ["Trainer", "summary_dir"]

log = logging.getLogger("axplug.trainer")


class Trainer(Configurable):
    """Trains `model` on `input` with `learner` over `mesh`, checkpointing to `output_dir`."""

    @config_class
    class Config(Configurable.Config):
        output_dir: Required[str] = REQUIRED
        model: Required[InstantiableConfig] = REQUIRED
        learner: Learner.Config = Learner.default_config()
        input: InstantiableConfig = ByteTextInput.default_config()
        eval_input: InstantiableConfig | None = None
        mesh: MeshBuilder.Config = MeshBuilder.default_config()
        checkpointer: Checkpointer.Config = Checkpointer.default_config()
        aux_loss: AuxLossRule.Config = AuxLossRule.default_config()
        watchdog: Watchdog.Config = Watchdog.default_config()
        # Writers whose `dir` is REQUIRED write under output_dir; dashboards are plugins'
        # writers, added with `--writer NAME`.
        summary_writers: list = [JsonlWriter.default_config(), ProgressBar.default_config()]
        max_steps: int = 100
        checkpoint_every: int = 50
        eval_every: int | None = None
        eval_batches: int = 4
        # Configs of evaluators run every eval_every steps beside the eval loss: each instance
        # is called as `evaluator(trainer, params, step)` and returns scalars to log (a
        # plugin's modifier adds them, e.g. benchmark tasks).
        evaluators: list = []
        log_every: int = 10
        seed: int = 0
        # The parts' own settings: where a run starts, how saves fail, the non-finite guard,
        # a profiler window.
        restore: Restorer.Config = Restorer.Config()
        saving: Saver.Config = Saver.Config()
        guard: NonFiniteGuard.Config = NonFiniteGuard.Config()
        profile: StepProfiler.Config = StepProfiler.Config()
        # Peak FLOP/s of one device for the logged MFU; None: the detected accelerator's device
        # spec (from the hardware plugins' mesh rules), and no MFU where there is none (CPU).
        peak_flops_per_device: float | None = None
        # Where `train()` (and `axplug train`) persist compiled programs while they run; None:
        # the process's own jax settings (building a Trainer never changes them), as for the
        # default when JAX_COMPILATION_CACHE_DIR is set.
        compilation_cache_dir: str | None = DEFAULT_CACHE_DIR

        RENAMED = {  # before plugin API 1.12 these were the trainer's own fields
            **{k: f"restore.{k}" for k in ("init_from", "init_step", "init_optimizer")},
            "on_corrupt_checkpoint": "restore.on_corrupt",
            "on_save_error": "saving.on_error",
            "max_nonfinite_steps": "guard.max_steps",
            "nonfinite_guard": "guard.mode",
            "profile_steps": "profile.steps",
        }

    _config: Config

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Raises the ConfigError a run would for `cfg` in what can be checked without
        building or writing anything: the trainer's own fields, the learner's choices, the
        checkpointer's retention, each summary writer's `check_config`. The trainer checks
        first; `axplug train --print-config` checks too."""
        check_trainer_config(cfg)

    def __init__(self, cfg: Config, *, hooks: tuple = (), devices: list | None = None):
        super().__init__(cfg)
        type(self).check_config(cfg)
        self.goodput = GoodputRecorder()  # counts from here: building is `setup`
        # Process 0's goodput record of this attempt, made by run().
        self.attempt: AttemptRecorder | None = None
        self.mesh_builder = cfg.mesh.instantiate()
        self.mesh = self.mesh_builder.build(devices)
        self.model = cfg.model.instantiate(parent=None, _path="model")
        self.learner = cfg.learner.instantiate()
        # With several processes, each produces only the rows its devices hold.
        rules = self.mesh_builder.axis_rules
        rows = NamedSharding(self.mesh, batch_partition_spec(self.mesh, rules))
        self.input = shard_input_config(cfg.input, rows).instantiate()
        self.eval_input, self.evaluators = build_evaluation(cfg, rows)
        checkpointer_cfg = cfg.checkpointer.clone()
        if checkpointer_cfg.directory is REQUIRED:
            checkpointer_cfg.directory = f"{cfg.output_dir.rstrip('/')}/checkpoints"
        self.checkpointer = checkpointer_cfg.instantiate()
        self.aux_loss = cfg.aux_loss.instantiate()
        # Process 0 writes the summaries; the others would write the same values.
        primary = jax.process_index() == 0
        self.writers = (
            [
                build_writer(w.located(f"summary_writers[{i}]"), cfg, tokens_per_step(cfg.input))
                for i, w in enumerate(cfg.summary_writers)
            ]
            if primary
            else []
        )
        # Process 0's lease on the run directory, held while training (train() also holds it
        # around writing config.txt): a second run into the directory is refused.
        self.run_lock = (
            RunDirLock(summary_dir(cfg.output_dir)) if primary else contextlib.nullcontext()
        )
        self.hooks = HookRunner(registry.plugin_manager(*hooks))
        self.watchdog = hooked_watchdog(cfg.watchdog, self)
        self._build_step()
        self.restorer = Restorer(
            cfg.restore, self.checkpointer, self.layout, self.goodput, self.init_state
        )
        saved = lambda step, path: self.hooks(
            "on_checkpoint_saved", trainer=self, step=step, path=path
        )
        self.saver = Saver(cfg, self.checkpointer, self.input, self.restorer, self.goodput, saved)

    # --- setup -----------------------------------------------------------------------------

    def _build_step(self) -> None:
        cfg = self._config
        rules = self.mesh_builder.axis_rules
        self.param_specs = self.model.create_parameter_specs_recursively()
        param_shardings = parameter_shardings(self.param_specs, self.mesh, rules)
        self.schedule = self.learner.schedule(cfg.max_steps)
        # Frozen parameters (learner.trainable) are left out of the optimizer and its state;
        # a fine-tune's checkpoints leave them out too (`Restorer.frozen_source` names their run).
        masks = frozen_masks(update_kinds(self.param_specs, cfg.learner.trainable))
        self.tx = self.learner.transform(pick(masks[0], self.param_specs), cfg.max_steps)
        abstract_params = jax.eval_shape(
            self.model.initialize_parameters_recursively, jax.random.PRNGKey(0)
        )
        self.layout = StateLayout.build(self.tx, abstract_params, param_shardings, masks)
        self.batch_sharding = NamedSharding(self.mesh, batch_partition_spec(self.mesh, rules))
        scope = make_scope(self.mesh, rules)
        for input_cfg in (cfg.input, cfg.eval_input):
            check_input_split(input_cfg, scope, self.learner.grad_accumulation_steps)
        step = build_train_step(
            self.model,
            self.tx,
            self.aux_loss,
            seed=cfg.seed,
            grad_accumulation_steps=self.learner.grad_accumulation_steps,
            learning_rate=self.schedule,
            trainable=cfg.learner.trainable,
            guard=guard_for(self.mesh.devices.flat[0].platform, cfg.guard.mode),
        )
        self._train_step, self._eval_step = jit_steps(
            step, self.model, self.mesh, rules, self.layout.shardings, self.batch_sharding
        )

    def lower_step(self, batch: dict | None = None) -> jax.stages.Lowered:
        """The train step lowered for the abstract state and `batch` (arrays or
        ShapeDtypeStructs; default: `input.batch_size x input.seq_len` token ids): what
        `axplug aot` compiles without running, and tests inspect."""
        if batch is None:
            cfg = self._config.input
            token = jax.ShapeDtypeStruct(
                (cfg.batch_size, cfg.seq_len), jnp.int32, sharding=self.batch_sharding
            )
            batch = {"input_ids": token, "target_labels": token}
        return self._train_step.lower(self.layout.abstract, batch)

    def init_state(self) -> dict:
        """Fresh parameters (from the seed) and optimizer state, laid out on the mesh."""
        return self.layout.init_state(self.model, self._config.seed)

    def restore_or_init(self) -> dict:
        """The latest complete checkpoint that restores and verifies, else a fresh state (or
        the `init_from` weights); see `axplug.trainer.restore`."""
        return self.restorer.restore_or_init()

    def _policy(self, state: dict) -> Policy:
        return Policy(self.model, state["params"], self.mesh, self.mesh_builder.axis_rules)

    def put_batch(self, batch: dict) -> dict:
        """Global batch arrays from this process's rows."""
        return put_process_batch(batch, self.batch_sharding)

    # --- running -----------------------------------------------------------------------------

    def evaluate_all(self, params: Any, step: int) -> dict[str, float]:
        """The eval loss (with an eval input) and every evaluator's scalars at `step`."""
        scalars = {"eval_loss": self.evaluate(params)} if self.eval_input is not None else {}
        for evaluator in self.evaluators:
            scalars.update(evaluator(self, params, step))
        return scalars

    def evaluate(self, params: Any) -> float:
        batches = self.eval_input.iter_from(0)
        losses = [
            self._eval_step(params, self.put_batch(next(batches)[1]))
            for _ in range(self._config.eval_batches)
        ]
        return float(np.mean(jax.device_get(losses)))

    def run(self) -> dict:
        """Trains from the latest checkpoint (or scratch) to max_steps; returns final metrics.

        SIGTERM or SIGINT stops it after the step in flight, saved: it raises `Preempted`."""
        from axplug.runtime import set_last_saved

        set_last_saved(self.checkpointer.latest_step)
        with self.run_lock, StopSignals() as self._signals:
            return self._run()

    def _run(self) -> dict:
        cfg = self._config
        self.goodput.switch("other")
        self.watchdog.start_startup("restoring the latest checkpoint")
        try:
            state = self.restore_or_init()
        except BaseException:
            self.watchdog.stop()
            raise
        self.watchdog.phase("waiting for the first batch")
        start = int(jax.device_get(state["step"]))
        restore_input_state(self.input, start, self.restorer.metadata, self.checkpointer.directory)
        with contextlib.ExitStack() as writers:  # closed on every way out, after the goodput
            for writer in self.writers:
                writers.enter_context(writer)
                writer.truncate(start + 1)  # steps after the checkpoint are logged again
            guard = NonFiniteGuard(cfg.guard.max_steps)
            timer = StepTimer.for_run(cfg, self.model, self.mesh)
            self.hooks("on_train_start", trainer=self)
            if start >= cfg.max_steps:
                log.info(
                    "already at step %d of max_steps %d: nothing to train", start, cfg.max_steps
                )
            self.attempt = attempt_recorder(cfg, self.goodput, start)
            try:
                last = self._train_loop(state, start, guard, timer)
            except Preempted:
                self._goodput_report("preempted")
                raise
            report = self._goodput_report("done")
            for writer in self.writers:
                writer.write_run_summary(int(last["step"]), report)
        last = {**last, **report}
        self.hooks("on_train_end", trainer=self, metrics=last)
        return last

    def _train_loop(self, state: dict, start: int, guard: NonFiniteGuard, timer: StepTimer) -> dict:
        """Steps from `start` to max_steps; returns the last step's metrics, keeps the state."""
        cfg = self._config
        last: dict = {"step": start}
        pending: tuple[int, Any] | None = None
        agreement = StopAgreement(self.mesh)
        profiler = StepProfiler.for_run(cfg, start) or StepProfiler.idle()
        try:
            batches = self.input.iter_from(start)
            if self._signals.requested is not None and jax.process_count() == 1:
                self.state = state
                raise Preempted(start, self._signals.requested, saved=False)
            for step in range(start, cfg.max_steps):
                profiler.before_step(step + 1, state)
                with self.goodput.phase("data_wait"):
                    self.input.before_batch(step, self._policy(state))
                    batch = self.put_batch(next(batches)[1])
                if step == start:
                    self.watchdog.phase("compiling the train step")
                    self._compile(state, batch)
                with self.goodput.phase("step"):
                    state, metrics = self._train_step(state, batch)
                    # at the window's end: waits, stops the trace
                    profiler.after_step(step + 1, (state, metrics))
                if pending is not None:  # read the previous step's metrics while this one runs
                    last = self._on_step_end(*pending, guard, timer)
                pending = (step + 1, metrics)
                done = step + 1
                if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
                    last = self._on_step_end(*pending, guard, timer)
                    pending = None
                    with self.goodput.phase("checkpoint"):
                        self.saver.save(state, done)
                elif (local := self.checkpointer.local) is not None and local.due(done):
                    with self.goodput.phase("checkpoint"):
                        local.save(done, state)  # logs a failure; the persistent tier decides
                evaluating = self.eval_input is not None or self.evaluators
                if cfg.eval_every and evaluating and done % cfg.eval_every == 0:
                    with self.goodput.phase("eval"):
                        scalars = self.evaluate_all(state["params"], done)
                    self._write(done, scalars)
                    self.hooks("on_eval_end", trainer=self, step=done, metrics=scalars)
                if agreement.update(self._signals.requested is not None) and done < cfg.max_steps:
                    self.state = state
                    if pending is not None:
                        self._on_step_end(*pending, guard, timer)
                    self.saver.save_and_stop(state, done, self._signals.requested)
            if pending is not None:
                last = self._on_step_end(*pending, guard, timer)
        finally:
            profiler.close()  # a run that ends or raises inside the window
            self.watchdog.stop()
            with self.goodput.phase("checkpoint"):
                self.saver.finish()
        self.state = state
        return last

    def _compile(self, state: dict, batch: dict) -> None:
        # Compiling ahead of the first call fills the cache that call uses, so the time is
        # counted as compilation and the watchdog's clock starts after it.
        log.info("compiling the train step")
        with self.goodput.phase("compile"):
            seconds, cache = compile_ahead(self._train_step, state, batch)
        log.info("compiled the train step in %.1f s (%s)", seconds, cache)
        self.watchdog.start(int(jax.device_get(state["step"])))
        self._busy_mark = self._busy_seconds()

    def _goodput_report(self, end: str) -> dict:
        step = int(jax.device_get(self.state["step"]))
        slow = len(self.watchdog.slow_steps)
        return goodput_report(self.goodput, slow, self.attempt, step, end)

    def _busy_seconds(self) -> float:
        return self.goodput.total(("data_wait", "step", "other"))

    def local_devices(self) -> list:
        """This process's devices of the mesh."""
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    def _on_step_end(
        self, step: int, metrics: Any, guard: NonFiniteGuard, timer: StepTimer
    ) -> dict:
        with self.goodput.phase("step"):
            metrics = jax.device_get(metrics)
            histograms = metrics.pop("histograms", {})
            values = {k: v.item() for k, v in metrics.items()}
        # Host time between step completions, leaving out checkpoints and evaluations.
        busy = self._busy_seconds()
        seconds = busy - self._busy_mark
        self.watchdog.step_completed(step, seconds, timer.mfu(seconds))
        self._busy_mark = busy
        finite = bool(values.pop("finite"))
        guard.update(step, finite, values.get("loss"))
        values.update(timer.tick(step, seconds))  # an eval's or a save's time left out
        values.update(self.input.metrics(step))
        cfg = self._config
        if step % cfg.log_every == 0 or step == cfg.max_steps or not finite:
            self._write(step, values)
            for writer in self.writers:
                writer.write_histograms(step, histograms)
        else:  # a progress display moves every step; files and sinks every log_every
            self._write(step, values, every_step_only=True)
        self.hooks("on_step_end", trainer=self, step=step, metrics=values)
        if self.attempt is not None:
            self.attempt.step_completed(step, self.goodput.seconds["step"])
        return {"step": step, **values}

    def _write(self, step: int, scalars: dict, *, every_step_only: bool = False) -> None:
        for writer in self.writers:
            if not every_step_only or writer.every_step:
                writer.write(step, scalars)

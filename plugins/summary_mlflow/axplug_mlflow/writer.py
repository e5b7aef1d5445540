"""`MlflowWriter`: an axplug run's metrics as one MLflow run."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Mapping

from axplug.config import REQUIRED, Required, config_class
from axplug.summary import SummaryWriter, group_tag, to_scalars

__all__ = ["MlflowWriter", "RUN_FILE"]

# Which MLflow run an axplug run writes to, kept in the run directory: a resume continues it.
RUN_FILE = "mlflow-run.json"


class MlflowWriter(SummaryWriter):
    """Logs scalars (tagged `train/`, `eval/`, `goodput/`, `moe/`...) to an MLflow run, one
    batch per logged step.

    The store is `tracking_uri`, else `MLFLOW_TRACKING_URI`, else a SQLite file in the run
    directory (`sqlite:///DIR/mlflow.db`; `mlflow ui --backend-store-uri` that URI shows
    it). The run id is kept in `DIR/mlflow-run.json`, so resuming the axplug run resumes the
    MLflow run; steps it already has (a resume from an earlier checkpoint replays them) keep
    their first values. A run that fails ends FAILED. MLflow stores infinities as the
    largest float; NaN as NaN.
    """

    @config_class
    class Config(SummaryWriter.Config):
        dir: Required[str] = REQUIRED
        tracking_uri: str | None = None
        experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else "axplug"
        run_name: str | None = None  # None: the run directory's name
        tags: dict = {}

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from mlflow.tracking import MlflowClient  # imported here: configuring stays cheap

        run_dir = pathlib.Path(cfg.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = (
            cfg.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        )
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id, self._last_step = self._resume(run_dir / RUN_FILE)
        if self.run_id is None:
            self.run_id = self._start(run_dir)
            (run_dir / RUN_FILE).write_text(
                json.dumps({"tracking_uri": self.tracking_uri, "run_id": self.run_id}) + "\n"
            )
        self._open = True

    def _resume(self, path: pathlib.Path) -> tuple[str | None, int]:
        """The run this directory wrote to before and its last step, if it is still there."""
        from mlflow.exceptions import MlflowException

        if not path.exists():
            return None, -1
        saved = json.loads(path.read_text())
        if saved.get("tracking_uri") != self.tracking_uri:
            return None, -1
        try:
            self.client.update_run(saved["run_id"], status="RUNNING")
            history = self.client.get_metric_history(saved["run_id"], "train/loss")
        except MlflowException:
            return None, -1  # deleted from the store: start a new run
        return saved["run_id"], max((m.step for m in history), default=-1)

    def _start(self, run_dir: pathlib.Path) -> str:
        cfg = self._config
        name = cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "axplug"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        run = self.client.create_run(
            experiment_id,
            run_name=cfg.run_name or run_dir.resolve().name,
            tags={str(k): str(v) for k, v in cfg.tags.items()},
        )
        return run.info.run_id

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        step = int(step)
        if step < self._last_step:
            return  # a step the MLflow run already has: resumed from an earlier checkpoint
        self._last_step = step
        now = int(time.time() * 1000)
        metrics = [
            Metric(group_tag(name), value, now, step) for name, value in to_scalars(scalars).items()
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        if self._open:
            self._open = False
            self.client.set_terminated(self.run_id, status=status)

    def __exit__(self, exc_type, *exc_info: object) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")

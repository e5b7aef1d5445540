"""`MlflowWriter`: an axplug run's metrics as one MLflow run."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from axplug.api.checkpoint import write_text
from axplug.api.config import (
    REQUIRED,
    ConfigValueError,
    Required,
    config_class,
    has_userinfo,
    strip_userinfo,
)
from axplug.api.summary import SummaryWriter, group_tag, to_scalars

__all__ = ["MlflowWriter", "RUN_FILE"]

# Which MLflow run an axplug run writes to, kept in the run directory: a resume continues it.
RUN_FILE = "mlflow-run.json"


class MlflowWriter(SummaryWriter):
    """Logs scalars (tagged `train/`, `eval/`, `goodput/`, `moe/`...) to an MLflow run, one
    batch per logged step.

    The store is `tracking_uri`, else `MLFLOW_TRACKING_URI`, else a SQLite file in the run
    directory (`sqlite:///DIR/mlflow.db`; `mlflow ui --backend-store-uri` that URI shows
    it). The run id is kept in `DIR/mlflow-run.json` (with the URI, less any user info), so
    resuming the axplug run resumes the MLflow run; steps it already has (a resume from an
    earlier checkpoint replays them) keep their first values. A run that fails ends FAILED.
    MLflow stores infinities as the largest float; NaN as NaN.

    `tracking_uri` holds no credentials (config.txt would): they go in the environment
    (`MLFLOW_TRACKING_URI` whole, or `MLFLOW_TRACKING_USERNAME`/`_PASSWORD`/`_TOKEN`).
    """

    @config_class
    class Config(SummaryWriter.Config):
        dir: Required[str] = REQUIRED
        tracking_uri: str | None = None
        experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else "axplug"
        run_name: str | None = None  # None: the run directory's name
        tags: dict = {}

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuses credentials in `tracking_uri`, and a file store MLflow would refuse."""
        if cfg.tracking_uri is not None and has_userinfo(cfg.tracking_uri):
            raise cfg.field_error(
                "tracking_uri",
                f"{strip_userinfo(cfg.tracking_uri)!r} with user info: put no credentials in "
                "the config (config.txt and checkpoints would hold them); give the whole URI "
                "in MLFLOW_TRACKING_URI instead, or for a server MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)",
            )
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri and _is_file_store(uri) and not _file_store_allowed():
            problem = (
                f"{uri!r} is a file store, which this MLflow opens only with "
                "MLFLOW_ALLOW_FILE_STORE=true; use a database store, e.g. "
                f"tracking_uri=sqlite:///{_file_path(uri)}/mlflow.db (or leave it unset: "
                "sqlite:///OUTPUT_DIR/mlflow.db), or set MLFLOW_ALLOW_FILE_STORE=true"
            )
            if cfg.tracking_uri:
                raise cfg.field_error("tracking_uri", problem)
            raise ConfigValueError(f"MLFLOW_TRACKING_URI: {problem}")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient  # imported here: configuring stays cheap

        self.check_config(cfg)
        run_dir = pathlib.Path(cfg.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = (
            cfg.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        )
        # What the run directory records: the store, never its credentials.
        self.shown_uri = strip_userinfo(self.tracking_uri)
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            resumed, self._last_step = self._resume(run_dir / RUN_FILE)
            self.run_id: str = resumed if resumed is not None else self._start(run_dir)
        except MlflowException as exc:
            raise self._refusal(exc) from exc
        record = json.dumps({"tracking_uri": self.shown_uri, "run_id": self.run_id}) + "\n"
        write_text(run_dir / RUN_FILE, record)  # a resume never reads half a record
        self._open = True

    def _refusal(self, exc: Exception) -> Exception:
        """One line for an MLflow error at start: a bad URI (exit 2), else a failed run (1)."""
        cfg = self._config
        where = cfg.field_path("tracking_uri") if cfg.tracking_uri else "MLFLOW_TRACKING_URI"
        text = strip_userinfo(str(exc)).strip()  # MLflow's messages echo the URI, user info too
        first = text.splitlines()[0] if text else type(exc).__name__
        if getattr(exc, "error_code", None) == "INVALID_PARAMETER_VALUE":
            return ConfigValueError(f"{where}: MLflow refuses {self.shown_uri!r}: {first}")
        return ConnectionError(f"MLflow store {self.shown_uri} ({where}): {first}")

    def _resume(self, path: pathlib.Path) -> tuple[str | None, int]:
        """The run this directory wrote to before and its last step, if it is still there."""
        from mlflow.exceptions import MlflowException

        if not path.exists():
            return None, -1
        try:
            saved = json.loads(path.read_text())
        except ValueError:
            return None, -1  # unreadable (written before records were atomic): a new run
        if strip_userinfo(str(saved.get("tracking_uri"))) != self.shown_uri:
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

    def __exit__(self, *exc_info: object) -> None:
        self.close("FAILED" if exc_info[0] is not None else "FINISHED")


def _is_file_store(uri: str) -> bool:
    """A `file:` URI or a plain path: MLflow's file store."""
    scheme, sep, _ = uri.partition("://")
    return not sep or scheme.lower() == "file" or uri.lower().startswith("file:")


def _file_path(uri: str) -> str:
    path = uri[len("file://") :] if uri.lower().startswith("file://") else uri
    return str(pathlib.Path(path).expanduser().resolve())


def _file_store_allowed() -> bool:
    """Whether this MLflow opens file stores: those before the flag always, newer ones with
    MLFLOW_ALLOW_FILE_STORE set (read as MLflow reads it)."""
    try:
        from mlflow import environment_variables
    except ImportError:
        return True  # building the writer says MLflow is missing
    flag = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return flag is None or bool(flag.get())

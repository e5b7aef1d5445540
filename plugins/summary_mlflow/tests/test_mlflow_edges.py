"""axplug-mlflow's refusals (a file store MLflow refuses, credentials in the config) as one
`error:` line before anything is written, and no credentials in any file a run writes."""

import itertools
import json
import types

import pytest
from axplug_testing import cli_main as main
from axplug_testing import tiny_train_args, tiny_trainer_config

pytest.importorskip("axplug_mlflow")


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and line != "mesh rule: cpu"]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_file_tracking_uri_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run = tmp_path / "run"
    uri = f"file://{tmp_path}/mlruns"
    args = [*tiny_train_args(run), "--mesh-rule", "none", "--writer", f"mlflow:tracking_uri={uri}"]
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: summary_writers[2].tracking_uri: '{uri}' is a file store")
    assert f"tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db" in line
    assert "MLFLOW_ALLOW_FILE_STORE=true" in line
    assert not run.exists() and not (tmp_path / "mlruns").exists()
    assert main([*args[:-2], "--print-config", *args[-2:]]) == 2  # refused there too
    assert one_error_line(capsys.readouterr().err) == line


def test_credentials_in_the_tracking_uri_are_refused_without_echoing_them(tmp_path, capsys):
    run = tmp_path / "run"
    writer = "mlflow:tracking_uri=https://bob:hunter2@mlflow.example.com"
    assert main([*tiny_train_args(run), "--mesh-rule", "none", "--writer", writer]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "summary_writers[2].tracking_uri: 'https://mlflow.example.com' with user info" in line
    assert "MLFLOW_TRACKING_URI" in line and "MLFLOW_TRACKING_PASSWORD" in line
    assert "hunter2" not in line and not run.exists()


class FakeClient:
    """The MlflowClient calls the writer makes, against a dict: no server needed."""

    runs: dict[str, dict] = {}
    uris: list[str] = []
    ids = itertools.count()

    def __init__(self, tracking_uri):
        self.uris.append(tracking_uri)

    def get_experiment_by_name(self, name):
        return None

    def create_experiment(self, name):
        return "0"

    def create_run(self, experiment_id, run_name, tags):
        run_id = f"run{next(self.ids)}"
        self.runs[run_id] = {"status": "RUNNING", "tags": tags}
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def update_run(self, run_id, status):
        self.runs[run_id]["status"] = status

    def get_metric_history(self, run_id, key):
        return []

    def log_batch(self, run_id, metrics):
        pass

    def set_terminated(self, run_id, status):
        self.runs[run_id]["status"] = status


def test_no_file_a_run_writes_holds_the_credentials(tmp_path, monkeypatch):
    import mlflow.tracking
    from axplug_mlflow import MlflowWriter
    from axplug_mlflow.writer import RUN_FILE

    from axplug.api.run import train

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FakeClient)
    secret_uri = "https://bob:hunter2@mlflow.example.com"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret_uri)  # the environment may hold them
    writer = MlflowWriter.default_config().set(
        tags={"source": "https://bob:hunter2@git.example.com/recipes"}
    )
    run = tmp_path / "run"
    cfg = tiny_trainer_config(run, "checkpoint_every=2", summary_writers=[writer])
    train(cfg, provenance={"argv": ["--set", f"restore.init_from={secret_uri}/x"]})
    assert FakeClient.uris[-1] == secret_uri  # the writer still logs in with them
    saved = json.loads((run / RUN_FILE).read_text())
    assert saved["tracking_uri"] == "https://mlflow.example.com"
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.parent.name == "metadata" for p in files)  # the checkpoint's metadata too
    holding = [str(p.relative_to(run)) for p in files if b"hunter2" in p.read_bytes()]
    assert holding == []
    assert "https://git.example.com/recipes" in (run / "config.txt").read_text()

    resumed = writer.clone(dir=str(run)).instantiate()  # found again by the stripped URI
    assert resumed.run_id == saved["run_id"]
    resumed.close()
    assert FakeClient.runs[saved["run_id"]]["status"] == "FINISHED"

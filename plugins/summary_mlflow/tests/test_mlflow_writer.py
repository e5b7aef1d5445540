"""axplug-mlflow against the run's metrics.jsonl: a local store, and a real MLflow tracking
server on 127.0.0.1 (resumed runs, failed runs, the --writer flag)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from axplug_testing import (
    expected_writer_scalars,
    scalars_match,
    tiny_trainer_config,
)

from axplug.api.config import REQUIRED
from axplug.api.summary import JsonlWriter


def tiny_run(tmp_path, writers, *extra, steps=4):
    return tiny_trainer_config(
        tmp_path, "checkpoint_every=2", "log_every=1", *extra, max_steps=steps,
        summary_writers=[JsonlWriter.default_config(), *writers],
    )  # fmt: skip


def mlflow_writer(**kwargs):
    pytest.importorskip("axplug_mlflow")
    from axplug_mlflow import MlflowWriter

    return MlflowWriter.default_config().set(**kwargs)


def mlflow_metrics(tracking_uri: str, run_id: str) -> dict[tuple[int, str], float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    keys = client.get_run(run_id).data.metrics
    return {(m.step, key): m.value for key in keys for m in client.get_metric_history(run_id, key)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 (SQLite store), stopped by its PID's group:
    the app `mlflow server` serves (mlflow.server.fastapi_app under uvicorn, one worker), started
    directly. `mlflow server` itself imports mlflow's server in a process of its own that only
    spawns that one, and migrates the database there first: 10.4 CPU-s to answer /health, 3.7
    this way (the app creates the tables itself on a fresh database)."""
    pytest.importorskip("axplug_mlflow")
    port = free_port()
    # What `mlflow server` hands its workers (mlflow.server.constants' variables). Without job
    # execution: the server would start seven job-consumer processes.
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{tmp_path / 'server.db'}",
        "_MLFLOW_SERVER_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
    }
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed with the server below
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "mlflow.server.fastapi_app:app"],
        stdout=subprocess.DEVNULL, stderr=log,
        env=env, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


# --- the tests ------------------------------------------------------------------------------


def test_mlflow_store_receives_the_jsonl_scalars(tmp_path):
    from axplug_mlflow.writer import RUN_FILE

    out = tmp_path / "run"
    final = tiny_run(out, [mlflow_writer(experiment="tests")]).instantiate().run()
    want = expected_writer_scalars(out, final)
    saved = json.loads((out / RUN_FILE).read_text())
    assert saved["tracking_uri"] == f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert scalars_match(mlflow_metrics(saved["tracking_uri"], saved["run_id"]), want)


def test_mlflow_server_on_loopback_resumes_the_same_run(tmp_path, mlflow_server):
    from axplug_mlflow.writer import RUN_FILE
    from mlflow.tracking import MlflowClient

    cfg = mlflow_writer(dir=str(tmp_path), tracking_uri=mlflow_server, experiment="served")
    with cfg.instantiate() as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": 1.0 / step, "eval_loss": 2.0, "goodput/wall_s": 9.5})
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["run_id"]
    with cfg.instantiate() as resumed:  # rerun into the same directory: the same MLflow run
        assert resumed.run_id == run_id
        resumed.write(2, {"loss": 99.0})  # replayed after a resume from step 1: kept as it was
        resumed.write(4, {"loss": float("nan")})
    got = mlflow_metrics(mlflow_server, run_id)
    want = {(s, "train/loss"): 1.0 / s for s in (1, 2, 3)}
    want |= {(s, "eval/loss"): 2.0 for s in (1, 2, 3)}
    want |= {(s, "goodput/wall_s"): 9.5 for s in (1, 2, 3)}
    want[(4, "train/loss")] = float("nan")
    assert scalars_match(got, want)
    run = MlflowClient(tracking_uri=mlflow_server).get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name


def test_mlflow_run_that_raises_ends_failed(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = mlflow_writer(dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"), cfg.instantiate() as writer:
        writer.write(1, {"loss": 1.0})
        raise RuntimeError("boom")
    run = MlflowClient(tracking_uri=writer.tracking_uri).get_run(writer.run_id)
    assert run.info.status == "FAILED"


def test_writer_flag_adds_a_registered_writer_and_names_bad_ones(tmp_path, capsys):
    from axplug_testing import cli_main as main
    from axplug_testing import train_config

    pytest.importorskip("axplug_mlflow")
    cfg = train_config(
        ["--preset", "gpt-tiny", "--mesh-rule", "none", "--writer", "mlflow:experiment='e1'"]
    )
    added = cfg.summary_writers[-1]
    assert added.klass.__name__ == "MlflowWriter" and added.experiment == "e1"
    assert added.dir is REQUIRED  # the trainer fills in the run directory
    assert len(cfg.summary_writers) == 3  # jsonl, progress, mlflow

    base = ["train", "--preset", "gpt-tiny", "--output-dir", str(tmp_path), "--mesh-rule", "none"]
    assert main([*base, "--writer", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "nosuch" in err and "Traceback" not in err
    assert main([*base, "--writer", "mlflow:bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "writer 'mlflow'" in err and "bogus" in err and "Traceback" not in err

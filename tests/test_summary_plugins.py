"""Summary writers from plugins: axplug-wandb (offline run files read back) and axplug-mlflow
(a local store and a real `mlflow server` on 127.0.0.1), against the run's metrics.jsonl."""

import json
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from axplug.config import REQUIRED
from axplug.summary import JsonlWriter, group_tag, read_jsonl
from axplug.testing import tiny_trainer_config


def tiny_run(tmp_path, writers, *extra, steps=4):
    return tiny_trainer_config(
        tmp_path, "checkpoint_every=2", "log_every=1", *extra, max_steps=steps,
        summary_writers=[JsonlWriter.default_config(), *writers],
    )  # fmt: skip


def jsonl_as_tags(path) -> dict[tuple[int, str], float]:
    """metrics.jsonl as {(step, dashboard tag): value}."""
    return {
        (r["step"], group_tag(k)): v
        for r in read_jsonl(path)
        for k, v in r.items()
        if k not in ("step", "time")
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-6) for k in a
    )


# --- Weights & Biases -----------------------------------------------------------------------


def wandb_records(path: pathlib.Path):
    """Protobuf records of a `.wandb` file: a 7-byte W&B header, then LevelDB log records
    ([u32 crc][u16 length][u8 type][data], in 32 KiB blocks; FIRST/MIDDLE/LAST chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def wandb_history(run_dir: pathlib.Path) -> tuple[dict, dict]:
    """({(step, key): scalar}, {(step, key): histogram counts}) of the offline runs in DIR/wandb."""
    scalars, histograms = {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    continue
                value = json.loads(item.value_json)
                if len(item.nested_key) > 1:  # a histogram: {name: {_type, bins, values}}
                    histograms.setdefault((step, item.nested_key[0]), {})[item.nested_key[1]] = (
                        value
                    )
                else:
                    scalars[(step, key)] = value
    return scalars, histograms


def wandb_writer(**kwargs):
    pytest.importorskip("axplug_wandb")
    from axplug_wandb import WandbWriter

    return WandbWriter.default_config().set(mode="offline", **kwargs)


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    # No network, no login, no settings from the developer's home.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


# --- MLflow ---------------------------------------------------------------------------------


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
    """A real `mlflow server` on 127.0.0.1 (SQLite store), stopped by its PID's group."""
    pytest.importorskip("axplug_mlflow")
    port = free_port()
    # Without job execution: the server would start seven job-consumer processes.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed with the server below
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--default-artifact-root", str(tmp_path / "artifacts")],
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


def test_wandb_offline_and_mlflow_store_receive_the_jsonl_scalars(tmp_path, wandb_env):
    from axplug_mlflow.writer import RUN_FILE

    out = tmp_path / "run"
    writers = [wandb_writer(project="tests"), mlflow_writer(experiment="tests")]
    final = tiny_run(out, writers).instantiate().run()
    want = jsonl_as_tags(out / "metrics.jsonl")
    assert {step for step, _ in want} == {1, 2, 3, 4} and (4, "train/loss") in want
    # The run's goodput at its last step: goodput.jsonl's record, not a metrics.jsonl line.
    (goodput,) = read_jsonl(out / "goodput.jsonl")
    want |= {(4, k): v for k, v in goodput.items() if k.startswith("goodput/")}
    assert want[(4, "goodput/wall_s")] == pytest.approx(final["goodput/wall_s"])

    scalars, _ = wandb_history(out)
    assert same(scalars, want)
    assert (out / "wandb-run-id").read_text().strip()

    saved = json.loads((out / RUN_FILE).read_text())
    assert saved["tracking_uri"] == f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert same(mlflow_metrics(saved["tracking_uri"], saved["run_id"]), want)


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
    assert same(got, want)
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


def test_wandb_writes_histograms_and_skips_steps_it_has(tmp_path, wandb_env):
    import numpy as np

    cfg = wandb_writer(dir=str(tmp_path))
    with cfg.instantiate() as writer:
        writer.write(5, {"loss": 1.0})
        writer.write_histograms(5, {"moe/expert_load": np.array([0.1, 0.2, 0.3, 0.4])})
        writer.write(3, {"loss": 7.0})  # behind the run: dropped, not a W&B warning
    scalars, histograms = wandb_history(tmp_path)
    assert scalars == {(5, "train/loss"): 1.0}
    (step, key), hist = next(iter(histograms.items()))
    assert (step, key) == (5, "moe/expert_load") and sum(hist["values"]) == 4


def test_writer_flag_adds_a_registered_writer_and_names_bad_ones(tmp_path, capsys):
    from axplug.cli.main import main
    from axplug.cli.train_cmd import add_parser, build_config

    pytest.importorskip("axplug_mlflow")
    import argparse

    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args(
        ["--preset", "gpt-tiny", "--mesh-rule", "none", "--writer", "mlflow:experiment='e1'"]
    )
    cfg = build_config(args)
    added = cfg.summary_writers[-1]
    assert added.klass.__name__ == "MlflowWriter" and added.experiment == "e1"
    assert added.dir is REQUIRED  # the trainer fills in the run directory
    assert len(cfg.summary_writers) == 4  # jsonl, tensorboard, progress, mlflow

    base = ["train", "--preset", "gpt-tiny", "--output-dir", str(tmp_path), "--mesh-rule", "none"]
    assert main([*base, "--writer", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "nosuch" in err and "Traceback" not in err
    assert main([*base, "--writer", "mlflow:bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "writer 'mlflow'" in err and "bogus" in err and "Traceback" not in err

"""Multi-process training: settings from flags/environment, per-process rows, and a real
two-process FSDP run on the CPU backend that is killed, resumed, and matches one process."""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args, xla_flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.input import ByteTextInput
from axplug.runtime import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    DistributedSpec,
    process_rows,
    put_process_batch,
    resolve_distributed,
    shard_input_config,
)
from axplug.summary import read_jsonl

# --- where the settings come from ------------------------------------------------------------


def test_single_process_when_nothing_asks_for_more():
    assert resolve_distributed(environ={}) is None
    assert resolve_distributed(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None


def test_flags_win_over_environment():
    env = {ENV_COORDINATOR: "10.0.0.9:99", ENV_NUM_PROCESSES: "8", ENV_PROCESS_ID: "5"}
    spec = resolve_distributed("127.0.0.1:1234", 2, 1, environ=env)
    assert spec == DistributedSpec("127.0.0.1:1234", 2, 1, None, spec.source)
    assert "--coordinator" in spec.source


def test_environment_alone():
    env = {ENV_COORDINATOR: "head:4321", ENV_NUM_PROCESSES: "4", ENV_PROCESS_ID: "3"}
    spec = resolve_distributed(environ=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("head:4321", 4, 3)
    assert spec.cluster is None
    assert ENV_PROCESS_ID in spec.source


def test_slurm_job_is_detected_and_left_to_jax():
    env = {
        "SLURM_JOB_ID": "123",
        "SLURM_STEP_NODELIST": "node[001-002]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    spec = resolve_distributed(environ=env)
    assert spec.cluster == "slurm"
    assert (spec.coordinator, spec.num_processes, spec.process_id) == (None, None, None)
    assert resolve_distributed(environ=env, cluster="none") is None


def test_multi_host_tpu_slice_and_named_clusters():
    spec = resolve_distributed(environ={"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"})
    assert spec.cluster == "gketpu"
    assert resolve_distributed(environ={}, cluster="tpu-vm").cluster == "gcetpu"


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        ({"coordinator": "127.0.0.1:1"}, {}, "also needs --num-processes (or JAX_NUM_PROCESSES)"),
        ({"coordinator": "no-port", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
        ({"num_processes": 2, "process_id": 2, "coordinator": "h:1"}, {}, "must be in [0, 2)"),
        ({}, {ENV_COORDINATOR: "h:1", ENV_NUM_PROCESSES: "two", ENV_PROCESS_ID: "0"}, "integer"),
        ({"cluster": "pbs"}, {}, "unknown cluster 'pbs'"),
    ],
)
def test_bad_settings_name_the_flag_or_variable(kwargs, env, message):
    with pytest.raises(ValueError, match=None) as info:
        resolve_distributed(environ=env, **kwargs)
    assert message in str(info.value)


def test_cli_reports_bad_multi_process_flags(capsys):
    from axplug.cli.main import main

    code = main(["train", "--preset", "gpt-tiny", "--output-dir", "x", "--process-id", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--coordinator (or JAX_COORDINATOR_ADDRESS)" in err


# --- rows of the global batch ----------------------------------------------------------------


def test_rows_of_one_process_are_the_whole_batch():
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    assert process_rows(sharding, 16) == (0, 16)
    cfg = ByteTextInput.default_config().set(batch_size=16, seq_len=8)
    assert shard_input_config(cfg, sharding) is cfg
    batch = ByteTextInput(cfg).batch(3)
    arrays = put_process_batch(batch, sharding)
    np.testing.assert_array_equal(np.asarray(arrays["input_ids"]), batch["input_ids"])
    assert arrays["input_ids"].sharding == sharding


def test_process_rows_concatenate_to_the_global_batch():
    # What shard_input_config gives each of 4 processes: their rows, in order, are the batch.
    cfg = ByteTextInput.default_config().set(batch_size=8, seq_len=8, seed=5)
    whole = ByteTextInput(cfg).batch(11)["input_ids"]
    parts = [
        ByteTextInput(cfg.clone(process_index=i, process_count=4)).batch(11)["input_ids"]
        for i in range(4)
    ]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


# --- two processes ---------------------------------------------------------------------------

STEPS = 8
TINY = (
    "log_every=1",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.attention.num_heads=4",
    "input.seq_len=16",
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(output_dir, cache_dir, devices, *extra, log=None):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(devices),
    }
    for var in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        env.pop(var, None)
    cache = f"compilation_cache_dir={str(cache_dir)!r}"
    train = tiny_train_args(output_dir, *TINY, cache, preset="llama-tiny",
                            modifiers=["mesh:fsdp=-1"], max_steps=STEPS)  # fmt: skip
    args = [sys.executable, "-m", "axplug.cli", *train, "--checkpoint-every", "2", *extra]
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _start_pair(output_dir, cache_dir, logs):
    flags = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    return [
        _start(output_dir, cache_dir, 4, *flags, "--process-id", str(i), log=logs[i])
        for i in range(2)
    ]


def _finish(procs, logs, timeout=420):
    deadline = time.time() + timeout
    for proc in procs:
        proc.wait(timeout=max(deadline - time.time(), 1))
    for proc, log in zip(procs, logs, strict=True):
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]


def _complete_steps(output_dir):
    ckpt = output_dir / "checkpoints"
    if not ckpt.exists():
        return []
    return sorted(p.name for p in ckpt.iterdir() if (p / "commit_success.txt").exists())


@pytest.mark.slow
def test_two_processes_fsdp_kill_resume_match_one_process(tmp_path):
    cache = tmp_path / "xla-cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    with open(tmp_path / "single.log", "w+") as log:
        _finish([_start(single, cache, 8, log=log)], [log])
    reference = [r["loss"] for r in read_jsonl(single / "metrics.jsonl")]
    assert len(reference) == STEPS

    logs = [open(tmp_path / f"multi{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    try:
        procs = _start_pair(multi, cache, logs)
        deadline = time.time() + 300
        while not _complete_steps(multi) and time.time() < deadline:
            assert all(p.poll() is None for p in procs), "a process exited before the kill"
            time.sleep(0.01)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc in procs:
            proc.wait()
        killed_at = len(read_jsonl(multi / "metrics.jsonl"))
        assert 2 <= killed_at < STEPS, f"killed after {killed_at} logged steps"

        for log in logs:
            log.seek(0)
            log.truncate()
        _finish(_start_pair(multi, cache, logs), logs)
    finally:
        for log in logs:
            log.close()

    records = read_jsonl(multi / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-6, atol=0)
    # Every process wrote its own shards of the sharded state.
    state = multi / "checkpoints" / f"step_{STEPS:08d}" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))
    # The restarted run restored: its goodput shows restore time and no fresh init.
    # The killed attempt's record comes from its progress.json, written by the rerun.
    killed, rerun = read_jsonl(multi / "goodput.jsonl")
    assert killed["end"] == "killed" and rerun["end"] == "done" and rerun["step"] == STEPS
    text = (tmp_path / "multi0.log").read_text()
    assert rerun["goodput/restore_s"] > 0 and rerun["goodput/init_s"] == 0, (rerun, text[-3000:])
    assert rerun["job/productive_steps"] == STEPS
    assert "process 0 of 2" in text and "resumed from step" in text

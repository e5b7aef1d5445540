"""The local checkpoint tier: a run killed during a persistent save resumes from the newer
local step, bit for bit; a lost local directory (on any process) or another layout falls back
to the persistent tier; bad settings name their field."""

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args, tiny_trainer_config, xla_flags

from axplug.cli.main import build_parser, main
from axplug.cli.train_cmd import build_config
from axplug.config import ConfigError
from axplug.summary import read_jsonl

STEPS = 12  # persistent every 6 (steps 6 and 12), local every 2 (2, 4, 8, 10; keep 2)
KILL_AT = 12  # during the persistent save of 12: the newest complete steps are 6 and local 10
TINY = ("log_every=1", "model.decoder.transformer.num_layers=1", "checkpointer.local.every=2")
KILLER = str(Path(__file__).with_name("kill_at_save.py"))
# The run's mesh: fsdp over the first two of the 8 devices, in this process and in the killed
# child (8 devices too: the compilation cache's key holds the count, so it reads this
# process's programs). Two shard every array as eight would, and compile, step and save faster.
MESH = "mesh:fsdp=2"


def _args(output_dir, local_dir, *extra, mesh=MESH):
    """The run's arguments; a child process compiles into (and reads) the session's cache."""
    sets = [*TINY, f"checkpointer.local.directory={str(local_dir)!r}"]
    args = tiny_train_args(output_dir, *sets, preset="llama-tiny", modifiers=[mesh],
                           max_steps=STEPS)  # fmt: skip
    return [*args, "--checkpoint-every", "6", "--seed", "3", *extra]


def _env(devices):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_flags(devices)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    return env


def _kill_during_save(args, log, devices=8):
    """The run of `args`, SIGKILLed during its persistent save of KILL_AT."""
    cmd = [sys.executable, KILLER, str(KILL_AT), *args]
    return subprocess.Popen(cmd, env=_env(devices), stdout=log, stderr=subprocess.STDOUT)


def _trainer(args, devices=None):
    return build_config(build_parser().parse_args(args)).instantiate(devices=devices)


def _persistent(output_dir):
    steps = (Path(output_dir) / "checkpoints").glob("step_*")
    return sorted(int(p.name[5:]) for p in steps if (p / "commit_success.txt").exists())


def _local(local_dir, process=0):
    return sorted(int(p.name[5:]) for p in (Path(local_dir) / f"process_{process}").glob("step_*"))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """((losses, final state) of the uninterrupted run, in this process; its directory), its
    last persistent step then made incomplete: what a kill during that save leaves (persistent
    6; local 8 and 10)."""
    root = tmp_path_factory.mktemp("interrupted")
    trainer = _trainer(_args(root / "run", root / "local"))
    trainer.run()
    losses = [r["loss"] for r in read_jsonl(root / "run" / "metrics.jsonl")]
    assert len(losses) == STEPS
    reference = losses, jax.device_get(trainer.state)
    trainer.checkpointer.uncommit(STEPS)
    assert _persistent(root / "run") == [6] and _local(root / "local") == [8, 10]
    return reference, root


def _resume_in_process(args, caplog, devices=None):
    with caplog.at_level(logging.INFO, logger="axplug"):
        trainer = _trainer(args, devices)
        trainer.run()
    return trainer, caplog.text


def _assert_matches(reference, output_dir, trainer):
    losses, state = reference
    records = read_jsonl(Path(output_dir) / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == losses  # exact, not approximate
    jax.tree.map(np.testing.assert_array_equal, state, jax.device_get(trainer.state))


def _copy_of_the_interrupted_run(interrupted, tmp_path, mesh=MESH):
    """The arguments of the interrupted run copied into tmp_path (run/ and local/)."""
    for name in ("run", "local"):
        shutil.copytree(interrupted[1] / name, tmp_path / name)
    return _args(tmp_path / "run", tmp_path / "local", mesh=mesh)


def test_killed_during_a_persistent_save_resumes_from_the_newer_local_step(
    tmp_path, interrupted, caplog
):
    out, local = tmp_path / "run", tmp_path / "local"
    args = _args(out, local)
    with open(tmp_path / "killed.log", "w+") as log:
        proc = _kill_during_save(args, log)
        proc.wait(timeout=300)
        log.seek(0)
        assert proc.returncode == -signal.SIGKILL, log.read()[-3000:]
    # The persistent save of 12 never completed; the local tier holds 8 and 10.
    assert _persistent(out) == [6]
    assert _local(local) == [8, 10]
    assert not (out / "checkpoints" / f"step_{STEPS:08d}" / "commit_success.txt").exists()

    trainer, logs = _resume_in_process(args, caplog)
    assert f"resumed from step 10 of the local tier {local / 'process_0'}" in logs
    _assert_matches(interrupted[0], out, trainer)
    assert _persistent(out) == [6, 12]


def test_lost_local_directory_resumes_from_the_persistent_tier(tmp_path, interrupted, caplog):
    args = _copy_of_the_interrupted_run(interrupted, tmp_path)
    shutil.rmtree(tmp_path / "local")  # the machine and its RAM disk are gone
    trainer, logs = _resume_in_process(args, caplog)
    assert "resumed from step 6 of" in logs and "local tier" not in logs
    _assert_matches(interrupted[0], tmp_path / "run", trainer)


def test_a_corrupt_newest_local_step_falls_back_to_the_older_local_step(
    tmp_path, interrupted, caplog
):
    args = _copy_of_the_interrupted_run(interrupted, tmp_path)
    shards = tmp_path / "local" / "process_0" / f"step_{10:08d}" / "shards.bin"
    data = bytearray(shards.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern: the CRC-32 catches it
    shards.write_bytes(bytes(data))
    trainer, logs = _resume_in_process(args, caplog)
    assert f"local tier: step 10 of {tmp_path / 'local' / 'process_0'} cannot be read" in logs
    assert f"resumed from step 8 of the local tier {tmp_path / 'local' / 'process_0'}" in logs
    _assert_matches(interrupted[0], tmp_path / "run", trainer)


def test_another_layout_ignores_the_local_tier(tmp_path, interrupted, caplog):
    args = _copy_of_the_interrupted_run(interrupted, tmp_path, mesh="mesh")  # one device
    trainer, logs = _resume_in_process(args, caplog)
    assert (
        f"local tier: not restoring step 10 of {tmp_path / 'local' / 'process_0'}: it was saved "
        "on another layout (1 process(es), 2 devices, mesh fsdp=2; now 1 process(es), "
        "1 devices, mesh none)"
    ) in logs
    assert "resumed from step 6 of" in logs
    assert int(trainer.state["step"]) == STEPS
    # The steps after the restored one are a history the run recomputed: replaced on 1 device.
    assert _local(tmp_path / "local") == [8, 10]


def test_a_replaced_persistent_directory_never_restores_old_local_steps(
    tmp_path, interrupted, caplog
):
    args = _copy_of_the_interrupted_run(interrupted, tmp_path)
    shutil.rmtree(tmp_path / "run")  # starting over into the same output directory
    with caplog.at_level(logging.INFO, logger="axplug"):
        trainer = _trainer(args)
        trainer.restore_or_init()  # how the run starts: the steps it then trains are not the claim
    trainer.checkpointer.close()
    assert "it belongs to another run" in caplog.text
    assert "initializing parameters and optimizer state" in caplog.text


@pytest.mark.parametrize(
    "setting, message",
    [
        ("every=0", "checkpointer.local.every: must be an int of at least 1, got 0"),
        ("keep_last=0", "checkpointer.local.keep_last: must be an int of at least 1, got 0"),
        ("directory='s3://b/x'", "checkpointer.local.directory: must be a path on this host"),
        ("directory='{tmp}/file/local'", "checkpointer.local.directory: {tmp}/file is a file, "
         "not a directory; give a directory on this host"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_field(tmp_path, setting, message):
    (tmp_path / "file").write_text("not a directory")
    setting, message = setting.format(tmp=tmp_path), message.format(tmp=tmp_path)
    cfg = tiny_trainer_config(tmp_path / "run", f"checkpointer.local.{setting}")
    with pytest.raises(ConfigError) as info:
        cfg.instantiate()
    assert str(info.value).startswith(message)
    assert not (tmp_path / "run").exists()


def test_cli_reports_a_bad_setting_in_one_line(tmp_path, capsys):
    args = tiny_train_args(tmp_path, "checkpointer.local.every=-2")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: checkpointer.local.every: must be an int of at least 1, got -2"


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(tmp_path, logs, *, kill):
    """Two processes x 4 devices, each with its own local directory (its host's)."""
    flags = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    procs = []
    for i, log in enumerate(logs):
        log.seek(0)
        log.truncate()
        args = _args(tmp_path / "run", tmp_path / f"host{i}", *flags, "--process-id", str(i),
                     mesh="mesh:fsdp=-1")  # fmt: skip
        cmd = [KILLER, str(KILL_AT)] if kill else ["-m", "axplug.cli"]
        procs.append(subprocess.Popen([sys.executable, *cmd, *args], env=_env(4), stdout=log,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    for proc in procs:
        proc.wait(timeout=300)
    texts = []
    for proc, log in zip(procs, logs, strict=True):
        log.seek(0)
        texts.append(log.read())
        assert (proc.returncode != 0) if kill else (proc.returncode == 0), texts[-1][-3000:]
    return texts


def _losses(tmp_path):
    return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}


@pytest.mark.slow
def test_two_processes_agree_on_the_tier(tmp_path):
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    try:
        _pair(tmp_path, logs, kill=True)
        assert _persistent(tmp_path / "run") == [6]
        assert _local(tmp_path / "host0", 0) == _local(tmp_path / "host1", 1) == [8, 10]

        # Both hold step 10: both restore it, and are killed during the save of 12 again.
        texts = _pair(tmp_path, logs, kill=True)
        for i, text in enumerate(texts):
            assert f"resumed from step 10 of the local tier {tmp_path / f'host{i}'}" in text
        from_local = _losses(tmp_path)

        # Process 1's host is gone: neither restores the local step 10 process 0 still has.
        shutil.rmtree(tmp_path / "host1")
        texts = _pair(tmp_path, logs, kill=False)
    finally:
        for log in logs:
            log.close()
    for text in texts:
        assert "local tier: step 10 is not complete on process 1" in text
        assert "resumed from step 6 of" in text and "of the local tier" not in text
    from_persistent = _losses(tmp_path)
    assert sorted(from_persistent) == list(range(1, STEPS + 1))
    # Steps 11 and 12 after the local restore equal those recomputed from step 6, exactly.
    assert [from_local[s] for s in (11, 12)] == [from_persistent[s] for s in (11, 12)]

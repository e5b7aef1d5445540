"""Preemption: SIGTERM / Ctrl-C save the step in flight and exit 75, the rerun resumes bit for
bit; a second signal exits at once; a lost peer is reported; goodput spans the attempts."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args, xla_flags

from axplug.checkpoint import Checkpointer
from axplug.cli.main import build_parser, main
from axplug.cli.train_cmd import build_config
from axplug.runtime import RESTART_EXIT_CODE, PeerMonitor
from axplug.summary import read_jsonl

STEPS = 40


def _args(output_dir, max_steps=STEPS, extra=()):
    overrides = ("log_every=1", "model.decoder.transformer.num_layers=1")
    args = tiny_train_args(output_dir, *overrides, max_steps=max_steps)
    return [*args, "--checkpoint-every", "10", "--seed", "5", *extra]


def _start(output_dir, **kwargs):
    """`axplug train` in a child process, compiling into (and reading) the session's cache."""
    command = [sys.executable, "-m", "axplug.cli", *_args(output_dir, **kwargs)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _logged(output_dir):
    path = output_dir / "metrics.jsonl"
    return len(read_jsonl(path)) if path.exists() else 0


def _wait_for_steps(proc, output_dir, count):
    deadline = time.time() + 120
    while _logged(output_dir) < count:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no progress"
        time.sleep(0.005)


def _finish(proc):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return err


def _trainer(output_dir):
    return build_config(build_parser().parse_args(_args(output_dir))).instantiate()


def _final_state(output_dir):
    directory = str(output_dir / "checkpoints")
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        return jax.device_get(checkpointer.restore(target=_trainer(output_dir).layout.abstract)[1])


def _complete_steps(output_dir):
    ckpt = output_dir / "checkpoints"
    if not ckpt.exists():
        return []
    return sorted(
        int(p.name.split("_")[1]) for p in ckpt.iterdir() if (p / "commit_success.txt").exists()
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run, in this process: its directory and final state."""
    run = tmp_path_factory.mktemp("reference") / "run"
    trainer = _trainer(run)
    trainer.run()
    return run, jax.device_get(trainer.state)


# SIGTERM at a seeded random step; Ctrl-C right at a checkpoint step (its asynchronous save
# still writing); SIGKILL, which saves nothing, for the goodput of a lost attempt. Ctrl-C's
# case runs by default: a signal's save and bit-identical rerun; the others are slow.
TERMINATED = pytest.param("SIGTERM", "random", marks=pytest.mark.slow)
KILLED = pytest.param("SIGKILL", "random", marks=pytest.mark.slow)


@pytest.mark.parametrize("sig, when", [TERMINATED, ("SIGINT", "at_save"), KILLED])
def test_a_signal_saves_the_step_in_flight_and_the_rerun_is_bit_identical(
    tmp_path, reference, sig, when
):
    ref_dir, ref_state = reference
    run = tmp_path / "run"
    target = 20 if when == "at_save" else random.Random(f"{sig}{when}").randint(3, STEPS - 12)
    proc = _start(run)
    _wait_for_steps(proc, run, target)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    reached = _logged(run)
    if sig == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
        saved = max(_complete_steps(run), default=0)
    else:
        assert proc.returncode == RESTART_EXIT_CODE, err[-3000:]
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("preempted at step")]
        assert lines == [f"preempted at step {reached} ({sig}): saved; rerun to resume"], err
        saved = reached
        assert saved in _complete_steps(run) and target <= saved < STEPS
        if when == "at_save":
            assert 20 in _complete_steps(run)  # the save in flight finished too
    assert main(_args(run)) == 0  # the rerun, in this process

    ref, res = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]  # exact, not approximate
    jax.tree.map(np.testing.assert_array_equal, ref_state, _final_state(run))

    # goodput.jsonl: one record per attempt, and the job's totals on the last.
    first, second = read_jsonl(run / "goodput.jsonl")
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["end"] == ("killed" if sig == "SIGKILL" else "preempted")
    assert second["end"] == "done" and second["start_step"] == saved
    lost = 0 if sig != "SIGKILL" else first["steps"] - saved
    assert second["lost_steps"] == lost and (sig != "SIGKILL" or lost > 0)
    assert second["job/attempts"] == 2 and second["job/lost_steps"] == lost
    assert second["job/productive_steps"] == STEPS
    assert second["job/steps_computed"] == first["steps"] + second["steps"] == STEPS + lost
    assert second["restart_s"] >= 0 and second["recovery_s"] > 0
    assert 0 < second["job/goodput_fraction"] < 1


def test_a_second_signal_exits_at_once_without_saving(tmp_path):
    proc = _start(tmp_path / "run", max_steps=100_000)
    seen = []

    def wait_for(text):
        for line in proc.stderr:
            seen.append(line)
            if text in line:
                return
        raise AssertionError("".join(seen))

    wait_for("building the trainer")  # seconds of work before any step: time for both
    proc.send_signal(signal.SIGTERM)
    wait_for("SIGTERM: finishing the step in flight, then saving")
    time.sleep(0.3)  # one within 0.25 s of the first is the same event (a parent's death)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    assert "SIGTERM again: exiting now, without saving" in rest
    assert "preempted at step" not in rest


class _Store:
    """The key-value calls of jax's distributed client, in memory."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_peer_that_stops_beating_is_named_within_the_timeout(monkeypatch):
    from axplug.runtime import peers

    store = _Store()
    monkeypatch.setattr(peers, "_client", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    lost = []
    monitor = PeerMonitor(1.0, lambda: 40, on_lost=lost.append)
    start = time.monotonic()
    monitor.start()
    # Process 1 beats, then process 2 ends on purpose; neither is lost. Process 1 then stops.
    for beat in range(8):
        store.values["axplug/heartbeat/1"] = str(beat)
        store.values["axplug/heartbeat/2"] = "done" if beat > 2 else str(beat)
        time.sleep(0.1)
    stopped = time.monotonic()
    while not lost and time.monotonic() - start < 5:
        time.sleep(0.02)
    monitor.stop()
    assert len(lost) == 1 and time.monotonic() - stopped < 1.0 + 0.2
    assert lost[0].startswith("lost process 1 of 3 (no heartbeat for ")
    assert lost[0].endswith(
        "process 0 stops. Newest complete checkpoint: step 40. Exit 75: restart every process "
        "with the same command to resume"
    )
    assert store.values["axplug/heartbeat/0"] == "done"  # it told the others it ended


def _beat(store, peer, stop):
    beat = 0
    while not stop.wait(0.05):
        beat += 1
        store.values[f"axplug/heartbeat/{peer}"] = str(beat)


@contextlib.contextmanager
def _watching_a_beating_peer(monkeypatch, store):
    """(monitor, lost messages, the event that stops process 1's beats) of process 0 of 2."""
    from axplug.runtime import peers

    stop, lost = threading.Event(), []
    monkeypatch.setattr(peers, "_client", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    beater = threading.Thread(target=_beat, args=(store, 1, stop))
    beater.start()
    monitor = PeerMonitor(1.0, on_lost=lost.append).start()
    try:
        yield monitor, lost, stop
    finally:
        stop.set()
        beater.join()
        monitor.stop()


def test_an_error_waits_until_every_peer_beats_again_or_is_named_lost(monkeypatch):
    """A collective (or a save waiting on it) fails at once when a peer dies, before the
    heartbeats go stale: the CLI holds any error until every peer has beaten since it (the
    error is then its own, reported at once) or the monitor names the lost peer (exit 75)."""
    from axplug.runtime import await_lost_peer, peers

    with _watching_a_beating_peer(monkeypatch, _Store()) as (monitor, lost, stop):
        monkeypatch.setattr(peers, "_monitor", monitor)
        start = time.monotonic()
        await_lost_peer(ValueError("this process's own error"))
        # Two polls (0.1 s apart) prove a beat after the error; a stale value read once does not.
        assert not lost and time.monotonic() - start < 0.5 and monitor._thread.is_alive()
        stop.set()
        await_lost_peer(RuntimeError("saving step 8 failed: barrier with process 1"))
        assert len(lost) == 1 and lost[0].startswith("lost process 1 of 2 (no heartbeat")
        assert not monitor._thread.is_alive()  # it returned once the monitor had spoken


class _FailingStore(_Store):
    """A store whose calls fail while `failing` is set (a loaded machine's deadline)."""

    def __init__(self):
        super().__init__()
        self.failing = threading.Event()

    def key_value_dir_get(self, prefix):
        if self.failing.is_set():
            raise RuntimeError("DEADLINE_EXCEEDED: the call took too long")
        return super().key_value_dir_get(prefix)


def test_process_0_rides_out_failing_store_calls_and_names_a_store_that_stays_down(monkeypatch):
    store = _FailingStore()
    with _watching_a_beating_peer(monkeypatch, store) as (monitor, lost, _):
        store.failing.set()
        time.sleep(0.5)  # under the 0.8 s it takes to call a heartbeat stale
        store.failing.clear()
        time.sleep(0.5)
        assert not lost and monitor._thread.is_alive()
        store.failing.set()
        monitor._thread.join(timeout=3)
        assert len(lost) == 1, lost
        assert lost[0].startswith("the coordination service in process 0 stopped answering")


def test_a_bad_peer_timeout_is_one_error_line(capsys, tmp_path):
    args = [*_args(tmp_path / "run"), "--peer-timeout", "0"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == "error: --peer-timeout must be > 0 seconds, got 0"


# --- two processes -----------------------------------------------------------------------------


def _pair(output_dir, port, steps):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(2)}  # fmt: skip
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--peer-timeout", "10"]
    args = [*_args(output_dir, max_steps=steps), "--modifier", "mesh:fsdp=-1", *flags]
    return [
        subprocess.Popen([sys.executable, "-m", "axplug.cli", *args, "--process-id", str(i)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_on_the_stop_step_and_a_lost_peer_is_reported(tmp_path):
    """SIGTERM to one process: both save the same step, exit 75; SIGKILL of process 1: the
    survivor exits 75 within the 10 s peer timeout naming it; the rerun matches an
    uninterrupted two-process run bit for bit."""
    steps = 40
    reference, run = tmp_path / "reference", tmp_path / "run"
    for proc in _pair(reference, _port(), steps):
        _finish(proc)

    procs = _pair(run, _port(), steps)
    _wait_for_steps(procs[0], run, 6)
    procs[1].send_signal(signal.SIGTERM)
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [RESTART_EXIT_CODE] * 2, errs
    reached = _logged(run)
    assert f"preempted at step {reached} (SIGTERM): saved" in errs[1]
    assert f"preempted at step {reached} (a signal to another process): saved" in errs[0]
    assert reached in _complete_steps(run)

    procs = _pair(run, _port(), steps)
    _wait_for_steps(procs[0], run, reached + 5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    err = procs[0].communicate(timeout=60)[1]
    took = time.monotonic() - killed
    assert procs[0].returncode == RESTART_EXIT_CODE and took < 10 + 2, (took, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("error: lost process")]
    assert len(lines) == 1 and lines[0].startswith("error: lost process 1 of 2 (no heartbeat")
    assert f"Newest complete checkpoint: step {max(_complete_steps(run))}" in lines[0]
    procs[1].wait()

    for proc in _pair(run, _port(), steps):
        _finish(proc)
    ref, res = read_jsonl(reference / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in res] == list(range(1, steps + 1))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]


def test_ctrl_c_in_any_other_command_is_one_line_and_exit_130(capsys):
    from axplug.cli.main import run_reporting_errors

    def interrupted():
        raise KeyboardInterrupt

    assert run_reporting_errors(interrupted) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted (SIGINT): stopped before finishing") and err.count("\n") == 1


def test_a_signal_repeated_at_once_is_one_event(capsys):
    """A multi-threaded parent that dies sends its death signal once per exiting thread: the
    repeats within 0.25 s of the first are the same stop, not an operator's second one."""
    from axplug.runtime import StopSignals

    with StopSignals() as stop:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # handled between bytecodes
        assert stop.requested == "SIGTERM"  # still here: not "exiting now"
    assert capsys.readouterr().err.count("SIGTERM") == 1

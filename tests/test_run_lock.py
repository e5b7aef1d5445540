"""The run directory's lease: a second run into a live run's directory is refused, a dead
run's lease is taken over, and the lease is re-entrant within a process."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from axplug.cli import main
from axplug.runtime import RunDirLock, RunDirLockedError
from axplug.runtime.run_lock import LOCK_FILE

HOLD = """
import sys, time
from axplug.runtime import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path's lease; killed (SIGKILL) by the test or at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_into_a_live_runs_directory_is_refused(tmp_path, holder, capsys):
    args = ["train", "--preset", "gpt-tiny", "--output-dir", str(tmp_path), "--max-steps", "2"]
    assert main([*args, "--set", "model.decoder.transformer.num_layers=1"]) == 2
    err = capsys.readouterr().err
    assert f"output_dir {tmp_path} is in use by another run (pid {holder.pid} on" in err
    assert "another --output-dir" in err
    # Nothing of the refused run was written: no config.txt, no checkpoints, no metrics.
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE]


def test_a_dead_runs_lease_is_taken_over_with_a_warning(tmp_path, holder, caplog):
    holder.send_signal(signal.SIGKILL)  # no chance to release: the kernel drops the flock
    holder.wait()
    lock = RunDirLock(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="axplug.trainer"):
        lock.acquire()
    try:
        assert f"from a run that ended without releasing it (pid {holder.pid} on" in caplog.text
    finally:
        lock.release()


def test_the_lease_is_reentrant_in_a_process_and_released_after_the_last_hold(tmp_path):
    first, second = RunDirLock(str(tmp_path)), RunDirLock(str(tmp_path / "."))
    with first, second:  # one process: train() around Trainer.run(), or two trainers in turn
        pass
    other = subprocess.run(
        [sys.executable, "-c", HOLD.replace("time.sleep(120)", ""), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 0 and other.stdout.strip() == "held"  # released: free again
    # While this process holds it, another process cannot take it.
    with first:
        other = subprocess.run(
            [sys.executable, "-c", HOLD.replace("time.sleep(120)", ""), str(tmp_path)],
            capture_output=True,
            text=True,
        )
    assert other.returncode != 0 and "RunDirLockedError" in other.stderr


def test_locked_error_is_a_config_error_for_the_cli_boundary():
    from axplug.config import ConfigError

    assert issubclass(RunDirLockedError, ConfigError)


class _FlakyStore:
    """An in-memory object store whose reads fail with ConnectionError while `down` is set."""

    def __init__(self):
        self.objects: dict[str, str] = {}
        self.down = False

    def join(self, *parts):
        return "/".join(parts)

    def read_text(self, url):
        if self.down:
            raise ConnectionError(f"cannot reach the server for {url}")
        if url not in self.objects:
            raise FileNotFoundError(url)
        return self.objects[url]

    def write_text(self, url, text):
        self.objects[url] = text

    def delete(self, url):
        self.objects.pop(url, None)


def test_a_store_lease_is_never_handed_over_while_the_store_does_not_answer(caplog):
    import time

    from axplug.runtime import StoreLease

    store = _FlakyStore()
    with StoreLease(store, "mem://run", ttl_s=0.4, settle_s=0.01) as holder:
        store.down = True  # an outage longer than the ttl: a newcomer fails, naming the store
        with pytest.raises(ConnectionError, match="cannot reach the server"):
            StoreLease(store, "mem://run", ttl_s=0.4, settle_s=0.01).acquire()
        time.sleep(0.5)
        store.down = False
        time.sleep(0.25)  # the holder's renewal survived the outage and renews again
        with pytest.raises(RunDirLockedError, match="in use by another run"):
            StoreLease(store, "mem://run", ttl_s=0.4, settle_s=0.01).acquire()
        assert holder.token in store.objects["mem://run/.axplug-lease.json"]
        store.objects["mem://run/.axplug-lease.json"] = "{not json"
        with pytest.raises(RunDirLockedError, match="not a lease record; delete it"):
            StoreLease(store, "mem://run", ttl_s=0.4, settle_s=0.01).acquire()
    assert "taken by another run" not in caplog.text

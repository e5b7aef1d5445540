"""The watchdog: slow-step flagging, hang reports with every thread's stack, and the exit code."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from axplug_testing import xla_flags

from axplug.runtime import HANG_EXIT_CODE, Watchdog, thread_stacks


def watchdog(**fields):
    hangs, slow = [], []
    dog = Watchdog(
        Watchdog.default_config().set(**fields),
        on_hang=lambda step, seconds, report: hangs.append((step, seconds, report)),
        on_slow_step=lambda step, seconds, median: slow.append((step, seconds, median)),
    )
    return dog, hangs, slow


def test_steps_slower_than_k_times_the_running_median_are_flagged():
    dog, _, slow = watchdog(
        timeout_s=None, slow_step_factor=3.0, slow_step_min_steps=5, slow_step_min_s=0.0
    )
    times = [0.10, 0.12, 0.09, 0.11, 0.10]  # median 0.10
    assert not any(dog.step_completed(i + 1, t) for i, t in enumerate(times))
    assert not dog.step_completed(6, 0.29)  # under 3 x 0.10
    assert dog.step_completed(7, 0.50)
    median = float(np.median([*times, 0.29]))  # the steps before it: 0.105
    assert slow == [(7, 0.50, pytest.approx(median))]
    assert dog.slow_steps == [7]


def test_no_flagging_before_enough_steps_are_known():
    dog, _, slow = watchdog(timeout_s=None, slow_step_min_steps=10)
    for step in range(1, 10):
        dog.step_completed(step, 1.0 if step < 9 else 100.0)
    assert slow == []


def test_short_steps_are_never_flagged():
    dog, _, slow = watchdog(timeout_s=None, slow_step_min_steps=3, slow_step_min_s=0.5)
    for step, seconds in enumerate([0.004, 0.004, 0.004, 0.096, 0.4, 2.0], start=1):
        dog.step_completed(step, seconds)
    assert [s[0] for s in slow] == [6]  # 0.096 s and 0.4 s are > 3x the median, but short


def test_sustained_low_mfu_is_flagged_once_per_window():
    low = []
    dog = Watchdog(
        Watchdog.default_config().set(timeout_s=None, min_mfu=0.3, utilization_window=4),
        on_low_utilization=lambda *args: low.append(args),
    )
    # Window 1 (steps 1-4): median 0.35, fine despite one slow step. Window 2: median 0.15.
    for step, mfu in enumerate([0.4, 0.05, 0.3, 0.4, 0.1, 0.2, 0.5, 0.1], start=1):
        dog.step_completed(step, 1.0, mfu)
    assert low == [(8, "mfu", pytest.approx(0.15), 0.3)]
    assert dog.low_utilization == low
    # Steps with no MFU (no device spec) never flag it.
    for step in range(9, 17):
        dog.step_completed(step, 1.0)
    assert len(low) == 1


def test_device_busy_percentage_is_read_at_each_windows_end():
    low, reads = [], []
    readings = iter([95.0, None, 20.0])  # None: the plugin could not read this time

    def read():
        reads.append(True)
        return next(readings)

    dog = Watchdog(
        Watchdog.default_config().set(
            timeout_s=None, min_device_busy_percent=50.0, utilization_window=2
        ),
        on_low_utilization=lambda *args: low.append(args),
        read_device_busy=read,
    )
    for step in range(1, 7):
        dog.step_completed(step, 1.0)
    assert len(reads) == 3 and low == [(6, "device_busy", 20.0, 50.0)]


def _stuck_in_a_collective(release):
    release.wait(10)


def test_hang_report_has_every_threads_stack_and_the_last_step_times():
    dog, hangs, _ = watchdog(timeout_s=0.3, exit_on_hang=False)
    release = threading.Event()
    stuck = threading.Thread(target=_stuck_in_a_collective, args=(release,), name="loader-7")
    stuck.start()
    try:
        dog.start(4)
        dog.step_completed(5, 0.125)
        deadline = time.time() + 10
        while not hangs and time.time() < deadline:
            time.sleep(0.02)
        assert len(hangs) == 1
        step, seconds, report = hangs[0]
        assert step == 5 and seconds > 0.3
        assert "no training step completed for" in report and "timeout_s = 0.3" in report
        assert "step 5: 0.125 s" in report
        assert 'Thread "loader-7"' in report and "_stuck_in_a_collective" in report
        assert "release.wait(10)" in report  # the line it is blocked on
        time.sleep(0.5)
        assert len(hangs) == 1  # reported once per stall, not once per poll
        dog.step_completed(6, 0.1)  # progress re-arms it
        deadline = time.time() + 10
        while len(hangs) < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert [h[0] for h in hangs] == [5, 6]
    finally:
        dog.stop()
        release.set()
        stuck.join()


def test_thread_stacks_names_the_calling_thread():
    text = thread_stacks()
    assert f'Thread "{threading.current_thread().name}"' in text
    assert "test_thread_stacks_names_the_calling_thread" in text


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("timeout_s", 0.0, "timeout_s: must be > 0 or None"),
        ("slow_step_factor", 1.0, "slow_step_factor: must be > 1 or None"),
        ("exit_code", 300, "exit_code: must be in [0, 255]"),
        ("min_mfu", 1.5, "min_mfu: must be in (0, 1] or None"),
        ("min_device_busy_percent", 0.0, "min_device_busy_percent: must be in (0, 100]"),
        ("utilization_window", 0, "utilization_window: must be >= 1"),
    ],
)
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=None) as info:
        Watchdog(Watchdog.default_config().set(**{field: value}))
    assert message in str(info.value)


HUNG_RUN = """
import logging, sys, time
from axplug.api import hookimpl
from axplug_testing import tiny_trainer_config
from axplug.trainer.run import train

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

class Stall:
    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        if step == 3:
            time.sleep(120)  # the injected hang

    @hookimpl
    def on_hang(self, trainer, step, seconds, report):
        print(f"ON_HANG step={step} stalled={seconds > 1.0}", flush=True)

cfg = tiny_trainer_config(
    sys.argv[1], "checkpoint_every=50", "model.decoder.transformer.num_layers=1",
    "input.seq_len=16", "watchdog.timeout_s=1.5", "watchdog.exit_on_hang=True", max_steps=50,
)
train(cfg, hooks=(Stall(),))
print("NOT REACHED", flush=True)
"""


def test_injected_hang_dumps_stacks_calls_the_hook_and_exits_75(tmp_path):
    script = tmp_path / "hung_run.py"
    script.write_text(textwrap.dedent(HUNG_RUN))
    env_flags = {"XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        env={**os.environ, **env_flags},
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT_CODE == 75, out[-3000:]
    assert time.time() - start < 120  # it did not wait for the 120 s sleep
    assert "HANG: no training step completed for" in out
    assert "last completed step: 3" in out  # step 3's on_step_end hook is the one stuck
    assert 'Thread "MainThread"' in out and "time.sleep(120)  # the injected hang" in out
    assert "in on_step_end" in out
    assert "ON_HANG step=3 stalled=True" in out
    assert "exiting with code 75 (watchdog.exit_on_hang)" in out
    assert "NOT REACHED" not in out


# 8 s: long enough that a loaded machine gets through the restore to the first batch.
STALLED_START = """
import sys, time
from axplug.input import IteratorInput
from axplug_testing import tiny_trainer_config
from axplug.trainer.run import train

cfg = tiny_trainer_config(
    sys.argv[1], "model.decoder.transformer.num_layers=1", "input.seq_len=16",
    "watchdog.startup_timeout_s=8", "watchdog.exit_on_hang=True", max_steps=5,
)
cfg.input = IteratorInput.default_config().set(
    make_iterator="never_batches:batches"
)
train(cfg)
print("NOT REACHED", flush=True)
"""

NEVER_BATCHES = """
import time

def batches(start_step):
    time.sleep(120)  # the first batch never comes
    yield {}
"""


def test_a_first_batch_that_never_comes_exits_75(tmp_path):
    (tmp_path / "stalled_start.py").write_text(textwrap.dedent(STALLED_START))
    (tmp_path / "never_batches.py").write_text(textwrap.dedent(NEVER_BATCHES))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tmp_path)}
    env["XLA_FLAGS"] = xla_flags(1)
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "stalled_start.py"), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == HANG_EXIT_CODE, out[-3000:]
    assert time.time() - start < 100
    assert "start-up stalled for" in out and "in waiting for the first batch" in out
    assert "time.sleep(120)  # the first batch never comes" in out
    assert "NOT REACHED" not in out


def test_startup_timeout_is_validated():
    with pytest.raises(ValueError, match="startup_timeout_s: must be > 0 or None"):
        Watchdog(Watchdog.default_config().set(startup_timeout_s=0.0))

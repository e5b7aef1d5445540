"""`axplug train` on a real pseudo-terminal, read as an operator sees it."""

import os
import pty
import re
import subprocess
import sys

from axplug.testing import tiny_train_args

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(*args: str, timeout: float = 300) -> str:
    """The terminal output of `axplug ARGS` (stdout and stderr on one pty), escapes removed."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "50", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "axplug.cli", *args],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=timeout) == 0, b"".join(chunks).decode(errors="replace")
    return ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def test_train_on_a_terminal_shows_status_then_a_bar_moving_every_step(tmp_path):
    def train(max_steps):
        args = tiny_train_args(tmp_path, "log_every=3", max_steps=max_steps)
        return run_in_pty(*args, "--mesh-rule", "none", "--checkpoint-every", "3")

    screen = train(6)
    bar = [(m.start(), int(m.group(1))) for m in re.finditer(r"step\s+(\d+)/6\s+\S*━", screen)]
    assert {step for _, step in bar} == set(range(1, 7))  # redrawn at every step
    first_bar = bar[0][0]
    for status in (
        "building the trainer",
        "initializing parameters and optimizer state",
        "compiling the train step",
        "compiled the train step in",
    ):
        assert 0 <= screen.find(status) < first_bar, status  # before the first step
    # One plain line per log_every above the bar: the loss history stays on screen.
    kept = re.findall(r"step (\d+)/6 loss \S+ tok/s \S+ eta", screen)
    assert kept == ["3", "6"]
    assert "done: step 6" in screen and "Traceback" not in screen

    screen = train(8)
    resumed = screen.find("resumed from step 6")
    assert 0 <= resumed < screen.find("/8")
    assert "done: step 8" in screen

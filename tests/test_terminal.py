"""`axplug train` on a real pseudo-terminal, read as an operator sees it."""

import contextlib
import logging
import os
import pty
import re
import threading

from axplug_testing import tiny_train_args

from axplug.cli import main

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(monkeypatch, *args: str) -> str:
    """The terminal output of `axplug ARGS` run in this process with stdout and stderr on one
    pseudo-terminal, escapes removed."""
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("LINES", "50")
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read_screen():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_screen, daemon=True)
    reader.start()
    logger = logging.getLogger("axplug")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        with (
            open(slave, "w", encoding="utf-8", buffering=1) as terminal,
            contextlib.redirect_stdout(terminal),
            contextlib.redirect_stderr(terminal),
        ):
            code = main(list(args))
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
        reader.join(30)
        os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    assert code == 0, screen
    return ANSI.sub("", screen)


def test_train_on_a_terminal_shows_status_then_a_bar_moving_every_step(tmp_path, monkeypatch):
    def train(max_steps):
        args = tiny_train_args(tmp_path, "log_every=3", max_steps=max_steps)
        return run_in_pty(monkeypatch, *args, "--mesh-rule", "none", "--checkpoint-every", "3")

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

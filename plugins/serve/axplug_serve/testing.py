"""The server `axplug serve` builds, run on a thread of the calling process: for tests of
clients (the OpenAI client, lm-eval) that need a real HTTP server but not its process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["metric_value", "serve_in_thread"]


def metric_value(exposition: str, name: str) -> float:
    """The sum of a metric's samples (every label set) in a /metrics page's text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith((name + " ", name + "{")))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(options: list[str], log: Path) -> Iterator[str]:
    """`axplug serve OPTIONS` (without `--port`: a free one is taken) on a uvicorn thread; yields
    its base URL once /health answers, and stops it on exit. The `axplug.serve` and uvicorn
    loggers also write to `log`, which must not show a traceback."""
    import uvicorn

    from axplug_serve import command

    parser = argparse.ArgumentParser(prog="axplug")
    command.add_parser(parser.add_subparsers())
    port = _free_port()
    app, _, _ = command.build(parser.parse_args(["serve", *options, "--port", str(port)]))
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ("axplug.serve", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="axplug-serve", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"axplug serve did not start:\n{log.read_text()}")
            time.sleep(0.05)
        urllib.request.urlopen(base + "/health", timeout=30).close()  # raises unless 2xx
        yield base
    finally:
        server.should_exit = True
        thread.join(60)
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()
    if thread.is_alive():
        raise RuntimeError("axplug serve did not stop within 60 s")
    if "Traceback" in log.read_text():
        raise AssertionError(f"axplug serve logged a traceback:\n{log.read_text()}")

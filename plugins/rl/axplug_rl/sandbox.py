"""Running untrusted Python (a model's code) in a contained child process."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO

from axplug_rl._sandbox_child import EXIT_SETUP, REFUSED

__all__ = ["SandboxResult", "run_python", "OUTPUT_LIMIT", "MIN_MEMORY_MB"]

OUTPUT_LIMIT = 64 * 1024  # bytes of stdout and of stderr kept: the head and the tail
MIN_MEMORY_MB = 64  # a Python interpreter and the standard library it imports
_CHILD = str(pathlib.Path(__file__).with_name("_sandbox_child.py"))


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended: `reason` is "ok", "timeout", "memory", "exit N",
    "signal N", or what it was refused: "filesystem", "network" or "process"."""

    ok: bool
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    reason: str


def run_python(code: str, *, timeout_s: float, memory_mb: int, stdin: str = "") -> SandboxResult:
    """Runs `code` as `__main__` in a child Python, contained: a fresh scratch directory as
    its cwd (removed afterwards) and the only place it may write; reads only there and in the
    standard library; no network, no new processes, no signals to processes outside (network
    and process-id namespaces where the kernel allows, and an audit hook everywhere);
    `memory_mb` of address space; killed after `timeout_s` seconds. The child is
    `python -I -S`: the standard library only, and none of the trainer's environment."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: must be a positive number of seconds")
    if memory_mb < MIN_MEMORY_MB:
        raise ValueError(f"memory_mb={memory_mb}: a Python child needs at least {MIN_MEMORY_MB}")
    scratch = tempfile.mkdtemp(prefix="axplug-sandbox-")
    try:
        pathlib.Path(scratch, "main.py").write_text(code, encoding="utf-8")
        # Files, not pipes: nothing to pump while waiting, and RLIMIT_FSIZE caps them.
        with (
            tempfile.TemporaryFile() as given,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
        ):
            given.write(stdin.encode("utf-8"))
            given.seek(0)
            cpu_s = math.ceil(timeout_s) + 1
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _CHILD, scratch, str(memory_mb), str(cpu_s)],
                stdin=given,
                stdout=out,
                stderr=err,
                cwd=scratch,
                env=_environment(scratch),
                start_new_session=True,
            )
            timed_out = _wait(proc, timeout_s)
            stdout, stderr = _read(out), _read(err)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    code_ = proc.returncode
    if code_ == EXIT_SETUP:
        raise RuntimeError(f"the sandbox could not start: {stderr.strip()}")
    # Past its CPU time: SIGXCPU, or SIGKILL a second later (process 1 of a namespace, or a
    # program, may ignore SIGXCPU); we send SIGKILL only when the wall clock ran out.
    if timed_out or code_ in (-signal.SIGXCPU, -signal.SIGKILL):
        reason, timed_out = "timeout", True
    elif code_ in REFUSED:
        reason = REFUSED[code_]
    elif code_ < 0:
        reason = f"signal {-code_}"
    else:
        reason = "ok" if code_ == 0 else f"exit {code_}"
    exit_code = None if timed_out or code_ < 0 else code_
    return SandboxResult(reason == "ok", exit_code, timed_out, stdout, stderr, reason)


def _environment(scratch: str) -> dict[str, str]:
    """Nothing of the trainer's environment (its tokens and keys): only what a program needs."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Waits for the child; past `timeout_s` (or if interrupted) kills its process group.
    Returns whether it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        if proc.returncode is None:  # not reaped, so its process group is still its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _read(file: IO[bytes]) -> str:
    """The file's text, its middle cut when over OUTPUT_LIMIT (a traceback is at the end)."""
    size = file.seek(0, os.SEEK_END)
    file.seek(0)
    if size <= OUTPUT_LIMIT:
        return file.read().decode("utf-8", "replace")
    half = OUTPUT_LIMIT // 2
    head = file.read(half)
    file.seek(size - half)
    cut = f"\n[... {size - 2 * half} bytes cut ...]\n".encode()
    return (head + cut + file.read()).decode("utf-8", "replace")

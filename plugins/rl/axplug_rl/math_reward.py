"""The `math` reward: an answer equal to the expected one as mathematics (math-verify), checked
in a worker process that holds sympy and its time limits, never in the trainer."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import weakref
from typing import Any

from axplug_rl.rewards import Reward, option_error

__all__ = ["MathReward"]

# The worker's program (`python -c`): one JSON request a line on stdin, one JSON answer a line
# on stdout. It bounds each request with its own SIGALRM: math-verify's timeouts are signals
# too, which work only in a main thread, so the trainer (any thread) calls it with them off.
_MATH_WORKER = """
import json, logging, os, resource, signal, sys
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
logging.disable(logging.WARNING)
from math_verify import parse, verify

class Late(BaseException):
    pass

def late(signum, frame):
    raise Late

def equal(gold, completion):
    golds = parse(gold, parsing_timeout=None) or parse("$" + gold + "$", parsing_timeout=None)
    found = parse(completion, parsing_timeout=None)
    return bool(golds and found and verify(golds, found, timeout_seconds=None))

signal.signal(signal.SIGALRM, late)
answers.write('{"ready": true}\\n')
answers.flush()
for line in sys.stdin:
    request = json.loads(line)
    try:
        signal.setitimer(signal.ITIMER_REAL, request["timeout_s"])
        try:
            answer = {"equal": equal(request["gold"], request["completion"])}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Late:
        answer = {"error": "timed out"}
    except Exception as exc:
        answer = {"error": type(exc).__name__ + ": " + str(exc)}
    answers.write(json.dumps(answer) + "\\n")
    answers.flush()
"""
_MATH_MEMORY_MB = 2048
_MATH_START_S = 60.0  # importing sympy on a loaded machine
_MATH_GRACE_S = 2.0  # past the worker's own alarm: it is stuck in C, so it is killed


class _MathWorker:
    """A long-lived child process running math-verify (sympy stays out of the trainer),
    restarted after it hangs or dies; one request at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        weakref.finalize(self, _MathWorker._stop, self.__dict__)

    @staticmethod
    def _stop(state: dict) -> None:
        proc = state.get("_proc")
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()
        state["_proc"] = None

    def _answer(self, proc: subprocess.Popen, wait_s: float) -> dict | None:
        assert proc.stdout is not None  # a pipe
        ready, _, _ = select.select([proc.stdout], [], [], wait_s)
        line = proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def equal(self, gold: str, completion: str, timeout_s: float) -> bool:
        """Whether math-verify finds `completion`'s answer equivalent to `gold`."""
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-P", "-c", _MATH_WORKER, str(_MATH_MEMORY_MB)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    encoding="utf-8",
                )
                if self._answer(self._proc, _MATH_START_S) is None:
                    self._stop(self.__dict__)
                    raise RuntimeError(
                        "math: the math-verify worker did not start; check that "
                        "`python -c 'import math_verify'` works"
                    )
            request = {"gold": gold, "completion": completion, "timeout_s": timeout_s}
            try:
                assert self._proc.stdin is not None  # a pipe
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                answer = self._answer(self._proc, timeout_s + _MATH_GRACE_S)
            except (OSError, ValueError):
                answer = None
            if answer is None:
                code = self._proc.poll()
                self._stop(self.__dict__)
                if code is not None:
                    raise RuntimeError(f"math: the math-verify worker died (exit {code})")
                raise TimeoutError(f"math: math-verify did not answer within {timeout_s}s")
        if answer.get("error") == "timed out":
            raise TimeoutError(f"math: math-verify took over {timeout_s}s")
        if "error" in answer:
            raise RuntimeError(f"math: math-verify failed: {answer['error']}")
        return bool(answer["equal"])


class MathReward(Reward):
    """1.0 when math-verify finds the completion's answer (LaTeX or plain, \\boxed first)
    equivalent to `sample[field]` (or to one of a list), else 0.0. It runs in a worker
    process, each verification bounded by `timeout_s` (a completion that takes longer fails:
    see `RewardSet`)."""

    name = "math"

    def __init__(self, *, field: str = "answer", timeout_s: float = 5.0, **options: Any):
        super().__init__(**options)
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise option_error(self.name, "timeout_s", timeout_s, "a positive number")
        self.field, self.timeout_s = field, float(timeout_s)
        self._worker = _MathWorker()

    def score(self, completion: str, sample: dict) -> float:
        gold = self._field(sample, self.field, "the expected answer")
        golds = gold if isinstance(gold, list | tuple) else [gold]
        return float(any(self._worker.equal(str(g), completion, self.timeout_s) for g in golds))

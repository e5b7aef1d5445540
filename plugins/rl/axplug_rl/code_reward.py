"""The `code` reward: a completion's program passes its sample's tests, run in the sandbox
(`axplug_rl.sandbox`), never in the trainer."""

from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from axplug_rl.rewards import Reward, option_error
from axplug_rl.sandbox import MIN_MEMORY_MB, run_python

__all__ = ["CodeReward", "extract_code"]

# ---- code
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last ```python (or untagged) fenced block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeReward(Reward):
    """1.0 when the completion's code, followed by `sample[field]` (Python test code, e.g.
    asserts, or a list of lines) in the same program, runs to its end in the sandbox within
    the limits, else 0.0; leaving early (`sys.exit(0)` before the tests) scores 0.0.
    `score_batch` runs `workers` programs at once."""

    name = "code"

    def __init__(
        self,
        *,
        field: str = "tests",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        workers: int = 2,
        **options: Any,
    ):
        super().__init__(**options)
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise option_error(self.name, "timeout_s", timeout_s, "a positive number")
        if not (isinstance(memory_mb, int) and memory_mb >= MIN_MEMORY_MB):
            raise option_error(self.name, "memory_mb", memory_mb, f"an int >= {MIN_MEMORY_MB}")
        if not (isinstance(workers, int) and workers >= 1):
            raise option_error(self.name, "workers", workers, "an int >= 1")
        self.field, self.timeout_s = field, float(timeout_s)
        self.memory_mb, self.workers = memory_mb, workers

    def score(self, completion: str, sample: dict) -> float:
        tests = self._field(sample, self.field, "the test code")
        if isinstance(tests, list | tuple):  # one assert a line, as in MBPP's `test_list`
            tests = "\n".join(map(str, tests))
        # Printed only once the tests ran: the program cannot know it by heart.
        done = secrets.token_hex(16)
        program = f"{extract_code(completion)}\n\n{tests}\n\nprint({done!r}, flush=True)\n"
        result = run_python(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        return float(result.ok and done in result.stdout)

    def score_batch(self, completions: list[str], samples: list[dict]) -> list[float]:
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions for {len(samples)} samples")
        with ThreadPoolExecutor(self.workers, thread_name_prefix="axplug-code") as pool:
            return list(pool.map(self.score, completions, samples))

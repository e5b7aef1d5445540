"""Recovery time of `axplug launch --local`: from a killed trainer to the next completed step.

    python bench/hot_swap_recovery.py                 # 3 repetitions each, hot and cold
    python bench/hot_swap_recovery.py --repeats 5 --no-cold

Hot: 2 trainers of 4 fake CPU devices and 1 standby host; process 1 is SIGKILLed once a
checkpoint is committed; the supervisor swaps the standby in and restarts both trainers from
that checkpoint; the figure is the supervisor's "recovered: ... done X s after" line (from
its noticing the death, within 50 ms of the kill). Cold: no standby; the job stops with exit
75 and is rerun at once (a scheduler's requeue with a machine ready), timed from the kill to
the rerun's first step line. Locally both restart the same processes, so their ratio is near
1: what a standby saves on a cluster is the scheduler finding and starting a new machine,
which is not on this machine to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from axplug_testing import tiny_train_args

from axplug.checkpoint.layout import COMMIT_MARKER

TINY = (
    "log_every=1",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.attention.num_heads=4",
    "input.seq_len=16",
)
_RECOVERED = re.compile(r"launch: recovered: step \d+ done ([\d.]+) s after host-1 failed")
_STEP = re.compile(r"^\[host-0\] step \d+/")


def _committed(ckpt: str) -> bool:
    """Whether a checkpoint step in `ckpt` is complete."""
    if not os.path.isdir(ckpt):
        return False
    return any(os.path.exists(os.path.join(ckpt, d, COMMIT_MARKER)) for d in os.listdir(ckpt))


class _Job:
    """`launch --local` with its output lines timestamped as they arrive."""

    def __init__(self, work: str, spares: int, steps: int, cache: str):
        train = tiny_train_args(os.path.join(work, "run"), *TINY,
                                f"compilation_cache_dir={cache!r}", preset="llama-tiny",
                                modifiers=["mesh:fsdp=-1"], max_steps=steps)  # fmt: skip
        self.work = work
        argv = [sys.executable, "-m", "axplug.cli", "launch", "--local", "--num-processes", "2",
                "--spares", str(spares), "--devices-per-host", "4",
                "--scratch-dir", os.path.join(work, "hosts"), "--",
                sys.executable, "-m", "axplug.cli", *train, "--checkpoint-every", "2"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def wait(self) -> int:
        code = self.proc.wait(600)
        self._reader.join(10)
        return code

    def kill_process_1(self) -> float:
        """SIGKILLs trainer 1 once a checkpoint is committed; the time of the kill."""
        ckpt = os.path.join(self.work, "run", "checkpoints")
        deadline = time.time() + 300
        while not _committed(ckpt):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("".join(line for _, line in self.lines[-40:]))
            time.sleep(0.01)
        with open(os.path.join(self.work, "hosts", "hosts.json")) as f:
            (pid,) = [h["pid"] for h in json.load(f)["hosts"] if h["process_id"] == 1]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        return killed_at


def hot(work: str, steps: int, cache: str) -> float:
    job = _Job(work, 1, steps, cache)
    job.kill_process_1()
    if job.wait() != 0:
        raise RuntimeError("".join(line for _, line in job.lines[-40:]))
    (seconds,) = [float(m.group(1)) for _, line in job.lines if (m := _RECOVERED.search(line))]
    return seconds


def cold(work: str, steps: int, cache: str) -> float:
    job = _Job(work, 0, steps, cache)
    killed_at = job.kill_process_1()
    if job.wait() != 75:
        raise RuntimeError("".join(line for _, line in job.lines[-40:]))
    rerun = _Job(work, 0, steps, cache)
    if rerun.wait() != 0:
        raise RuntimeError("".join(line for _, line in rerun.lines[-40:]))
    first = next(t for t, line in rerun.lines if _STEP.match(line))
    return first - killed_at


def _summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: median {statistics.median(values):.2f} s, min {min(values):.2f}, "
        f"max {max(values):.2f} over {len(values)} ({', '.join(f'{v:.2f}' for v in values)})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="max_steps of each run")
    parser.add_argument("--no-cold", action="store_true", help="only the hot swap")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="axplug-hot-swap-") as tmp:
        cache = os.path.join(tmp, "xla-cache")
        kinds = [("hot", hot)] + ([] if args.no_cold else [("cold", cold)])
        results: dict[str, list[float]] = {name: [] for name, _ in kinds}
        for rep in range(args.repeats):  # interleaved, so load changes hit both alike
            for name, measure in kinds:
                results[name].append(measure(os.path.join(tmp, f"{name}{rep}"), args.steps, cache))
                print(f"{name} {rep}: {results[name][-1]:.2f} s", flush=True)
        for name, values in results.items():
            print(_summary(f"{name} recovery (kill -> next step)", values))
        if "cold" in results:
            ratio = statistics.median(results["hot"]) / statistics.median(results["cold"])
            print(f"hot/cold median ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()

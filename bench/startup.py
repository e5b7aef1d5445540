"""Wall time of `axplug list` and `axplug --help` next to `python -c pass`.

    python bench/startup.py [--runs 7]

`axplug list` piped (as here) prints plain columns; `list (terminal)` is the rich table an
interactive terminal gets. Each command runs `--runs` times in a fresh process, the commands
interleaved so load from other processes hits all alike; the table gives the median and min
and the median over bare Python. Also reports whether `axplug list` imported jax (it must
not: listing plugins reads metadata only).

`--first-step` instead times what a small job costs before its first step: `train --from`
a tiny run (one step of fine-tuning, so the wall time is the time to the first step plus its
save) and `generate` of one token, each in a fresh process with an empty compilation cache
(HOME in a fresh temporary directory), `--runs` times interleaved. It prints each wall time
with its range, the train step's compile time (the run's goodput record) and the ratio wall /
compile (the goal: about 2x); `generate`'s own "first token after" line includes its compile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

__all__ = ["COMMANDS", "time_commands", "main"]

TARGET_S = 0.150  # over bare Python

_AS_TERMINAL = (
    "import sys; sys.stdout.isatty = lambda: True; "
    "from axplug.cli.main import main; sys.exit(main(['list']))"
)

# `axplug` runs through the interpreter (not the console script) so every row pays the
# same interpreter start-up and only the work after it differs.
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "axplug --help": [sys.executable, "-m", "axplug.cli", "--help"],
    "axplug list": [sys.executable, "-m", "axplug.cli", "list"],  # piped: plain columns
    "list (terminal)": [sys.executable, "-c", _AS_TERMINAL],  # the rich table a terminal gets
    "axplug list --json": [sys.executable, "-m", "axplug.cli", "list", "--json"],
}


def time_commands(commands: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """Wall seconds of each command, `runs` times, interleaved; raises if one fails."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    env = {**os.environ, "COLUMNS": "120"}
    for _ in range(runs):
        for name, argv in commands.items():
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
            times[name].append(time.perf_counter() - t0)
            if proc.returncode:
                raise RuntimeError(
                    f"`{name}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
                )
    return times


def imports_jax(argv: list[str]) -> bool:
    """Whether running `argv` (a `python -m ...` command) imports jax."""
    code = (
        "import runpy, sys; sys.argv = " + repr(argv[2:]) + "\n"
        "try:\n    runpy.run_module(" + repr(argv[2]) + ", run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX', file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "JAX_IMPORTED" in proc.stderr


_TINY = ["--set", "model.decoder.dim=32",
         "--set", "model.decoder.transformer.layer.feed_forward.hidden_dim=64"]  # fmt: skip


def first_step(runs: int) -> None:
    """`train --from` (1 step) and `generate` (1 token): wall, compile and their ratio."""
    import json
    import re
    import tempfile

    axplug = [sys.executable, "-m", "axplug.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        argv = ["train", "--preset", "gpt-tiny", "--output-dir", base, "--max-steps", "2", "-q"]
        subprocess.run([*axplug, *argv, *_TINY], check=True, capture_output=True)
        walls: dict[str, list[float]] = {"train --from": [], "generate": []}
        compiles, first_tokens = [], []
        for _ in range(runs):
            for name in walls:
                home = tempfile.mkdtemp(dir=tmp)  # an empty compilation cache
                out = os.path.join(home, "ft")
                argv = (["train", "--from", base, "--output-dir", out, "--max-steps", "1", "-q"]
                        if name == "train --from" else
                        ["generate", "--checkpoint", base, "--prompt", "HAMLET.",
                         "--max-new-tokens", "1", "--temperature", "0"])  # fmt: skip
                t0 = time.perf_counter()
                proc = subprocess.run([*axplug, *argv], capture_output=True, text=True,
                                      env={**os.environ, "HOME": home})  # fmt: skip
                walls[name].append(time.perf_counter() - t0)
                if proc.returncode:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {proc.stderr[-800:]}")
                if name == "train --from":
                    with open(os.path.join(out, "goodput.jsonl")) as f:
                        compiles.append(json.loads(f.readlines()[-1])["goodput/compile_s"])
                else:
                    found = re.search(r"first token after (\d+) ms", proc.stderr + proc.stdout)
                    first_tokens.append(int(found.group(1)) / 1e3 if found else float("nan"))

    def span(xs):
        return f"{statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}]"

    compile_s = statistics.median(compiles)
    print(
        f"time to first step, {runs} interleaved runs (load {os.getloadavg()[0]:.2f}), cold cache"
    )
    ratio = statistics.median(walls["train --from"]) / compile_s
    print(f"  train --from, 1 step: wall {span(walls['train --from'])}; its compile "
          f"{span(compiles)}; wall / compile {ratio:.2f}")  # fmt: skip
    print(f"  generate, 1 token:   wall {span(walls['generate'])}; first token (incl. compile) "
          f"{span(first_tokens)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--first-step", action="store_true", help="time to first step instead")
    args = p.parse_args(argv)
    if args.first_step:
        first_step(args.runs)
        return 0
    if shutil.which("axplug") is None and not os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "axplug")
    ):
        print("axplug is not installed in this environment", file=sys.stderr)
        return 2
    times_by = time_commands(COMMANDS, args.runs)
    bare = statistics.median(times_by["python -c pass"])
    print(f"start-up, {args.runs} interleaved runs each (load average {os.getloadavg()[0]:.2f})")
    print(f"{'command':16} {'median ms':>10} {'min ms':>8} {'over bare Python ms':>20}")
    for name, ts in times_by.items():
        med = statistics.median(ts)
        print(f"{name:16} {med * 1e3:10.0f} {min(ts) * 1e3:8.0f} {(med - bare) * 1e3:20.0f}")
    jax_list = imports_jax(COMMANDS["axplug list"])
    over = statistics.median(times_by["axplug list"]) - bare
    print(
        f"axplug list imports jax: {'yes' if jax_list else 'no'}; "
        f"{over * 1e3:.0f} ms over bare Python (target {TARGET_S * 1e3:.0f} ms): "
        f"{'OK' if over <= TARGET_S and not jax_list else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/launch.md "Failures and preemption", run as written (with a smaller model): the timeout's
SIGTERM saves and exits 75, the rerun resumes and finishes."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from axplug_testing import tiny_train_args

from axplug.summary import read_jsonl

PAGE = Path(__file__).resolve().parents[1] / "docs" / "launch.md"

# Stands in for `timeout --preserve-status --signal=TERM 60`: SIGTERM once the run has trained a
# few steps (progress.json), however long start-up takes on a loaded machine; the child's status.
TERM_AFTER_STEPS = """
import json, signal, subprocess, sys, time
proc, deadline = subprocess.Popen(sys.argv[2:]), time.monotonic() + 300
while proc.poll() is None:
    try:
        step = json.load(open(sys.argv[1]))["step"]
    except (OSError, ValueError, KeyError):
        step = 0
    if step >= 5 or time.monotonic() > deadline:
        proc.send_signal(signal.SIGTERM)
        break
    time.sleep(0.05)
sys.exit(proc.wait())
"""


def section_commands():
    text = PAGE.read_text()
    section = text.split("## Failures and preemption\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```sh\n(.*?)^```", section, flags=re.S | re.M)
    return block.strip().splitlines()


@pytest.mark.slow  # signals to child runs; test_preemption.py's default cases save on one
def test_the_preemption_commands_run_as_documented(tmp_path):
    lines = section_commands()
    assert lines[0].startswith("timeout --preserve-status --signal=TERM 60 axplug train ")
    # Tiny model and many more steps; the SIGTERM comes a few steps in, as the timeout's would.
    args = tiny_train_args("x", "model.decoder.transformer.num_layers=1")
    tiny = " ".join(f"--set {v!r}" for k, v in zip(args, args[1:], strict=False) if k == "--set")
    cache = f"--set compilation_cache_dir={str(tmp_path / 'cache')!r}"
    (tmp_path / "term_after_steps.py").write_text(TERM_AFTER_STEPS)
    progress = tmp_path / "runs" / "preempt" / "progress.json"
    timeout = f"{sys.executable} term_after_steps.py {progress}"
    script = "\n".join(
        line.replace("timeout --preserve-status --signal=TERM 60", timeout)
        .replace("--max-steps 200", f"--max-steps 1500 --checkpoint-every 500 {tiny} {cache}")
        .replace("axplug train", f"{sys.executable} -m axplug.cli train")
        for line in lines
    )
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-1500:]
    assert "exit code 75" in done.stdout, out[-1500:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("preempted at step")]
    step = int(line.split()[3])
    assert line == f"preempted at step {step} (SIGTERM): saved; rerun to resume"
    assert "done: step 1500" in done.stdout
    first, second = read_jsonl(tmp_path / "runs" / "preempt" / "goodput.jsonl")
    assert (first["end"], first["step"]) == ("preempted", step)
    assert (second["end"], second["start_step"], second["job/productive_steps"]) == (
        "done",
        step,
        1500,
    )

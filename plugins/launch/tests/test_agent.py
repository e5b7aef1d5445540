"""`axplug launch --agent`: the trainer restarted in place on exit 75 or a signal, up to a
budget; other exits end the agent with their code; a SIGTERM is passed on, not restarted."""

import signal
import subprocess
import sys
import time

import pytest
from axplug_testing import cli_main as main

# A stand-in trainer: counts its runs in a file, prints a step line, and exits `codes[run]`
# (the last one once past the end); "kill" dies from SIGKILL, "wait" waits for a signal.
FAKE = """
import os, pathlib, signal, sys, time
counter = pathlib.Path(sys.argv[1])
run = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(run + 1))
codes = sys.argv[2].split(",")
code = codes[min(run, len(codes) - 1)]
print(f"step {run + 1}/9 loss 1.0", flush=True)
if code == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if code == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    time.sleep(60)
sys.exit(int(code))
"""


def _argv(tmp_path, codes, *flags):
    return ["launch", "--agent", *flags, "--",
            sys.executable, "-c", FAKE, str(tmp_path / "runs"), codes]  # fmt: skip


def agent(tmp_path, capsys, codes, *flags):
    """The agent in this process (its trainers are children): (exit code, its output)."""
    code = main(_argv(tmp_path, codes, *flags))
    return code, capsys.readouterr().out


def runs(tmp_path):
    return int((tmp_path / "runs").read_text())


def test_exit_75_and_a_signal_restart_the_trainer_in_place(tmp_path, capsys):
    code, out = agent(tmp_path, capsys, "75,kill,0")
    assert code == 0, out
    assert runs(tmp_path) == 3
    assert "agent: trainer ended (exit 75: its state is safe); restart 1 of 5 in place\n" in out
    assert "agent: trainer ended (signal SIGKILL: it died); restart 2 of 5 in place\n" in out
    # Each restart's recovery: from the exit to the restarted trainer's first step line.
    assert "agent: restart 1 recovered: step 2 done " in out
    assert "agent: restart 2 recovered: step 3 done " in out


def test_the_agent_gives_up_after_its_restart_budget(tmp_path, capsys):
    code, out = agent(tmp_path, capsys, "75", "--max-restarts", "2")
    assert code == 1, out
    assert runs(tmp_path) == 3
    assert out.splitlines()[-1] == (
        "error: agent: the trainer asked for restart 3 (exit 75) but --max-restarts is 2; "
        "giving up (exit 1) so the scheduler sees a failed run"
    )


@pytest.mark.parametrize("code", [1, 2])
def test_a_failed_run_or_bad_config_is_not_restarted(tmp_path, capsys, code):
    exit_code, out = agent(tmp_path, capsys, str(code))
    assert exit_code == code and runs(tmp_path) == 1, out
    assert "restart" not in out


def test_sigterm_goes_to_the_trainer_and_ends_the_agent(tmp_path):
    # The agent in a process of its own, which the signal goes to.
    argv = [sys.executable, "-m", "axplug.cli", *_argv(tmp_path, "wait")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().startswith("step 1/9")
    time.sleep(0.3)  # the stand-in sets its handler after printing
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out  # the pod is going away: no restart
    assert runs(tmp_path) == 1
    assert "agent: trainer stopped (exit 75) after a signal" in out


def test_the_command_is_required(capsys):
    assert main(["launch", "--agent"]) == 2
    err = capsys.readouterr().err
    assert "launch --agent: give the command after --, e.g. -- axplug train ..." in err

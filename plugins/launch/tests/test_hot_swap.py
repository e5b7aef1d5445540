"""`axplug launch --local`: a killed trainer is replaced by a standby host (or, with
--elastic, the job shrinks), and the job ends where an uninterrupted run ends."""

import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from axplug_testing import cli_main, tiny_train_args

from axplug.api.checkpoint import CHECKSUMS_ITEM, METADATA_FILE, step_dir_name
from axplug.api.summary import read_jsonl

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "launch.md"
SECTION = "## Standby capacity and hot-swap"
STEPS = 8
TINY = (
    "log_every=1",
    "model.decoder.transformer.num_layers=2",
    "model.decoder.transformer.layer.attention.num_heads=4",
    "input.seq_len=16",
)
AXPLUG = [sys.executable, "-m", "axplug.cli"]


def docs_commands():
    """The `axplug launch --local` commands of the docs section, split like a shell would."""
    text = DOCS.read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, flags=re.S | re.M)
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    return {
        argv[argv.index("--output-dir") + 1]: argv
        for argv in map(shlex.split, lines)
        if argv[:3] == ["axplug", "launch", "--local"]
    }


def tiny_sets(cache_dir):
    """The tiny model and a shared compilation cache, as `--set` flags after the docs' own."""
    cache = f"compilation_cache_dir={str(cache_dir)!r}"
    args = tiny_train_args("unused", *TINY, cache, preset="llama-tiny", max_steps=STEPS)
    return ["--max-steps", str(STEPS), "--checkpoint-every", "2", *args[args.index("--set") :]]


def start_local(tmp, run, cache_dir, *flags, spares=None):
    """The docs' command for `runs/RUN` with `flags` (and --spares) instead of its own, in
    `tmp`, the model shrunk; its output in tmp/RUN.log."""
    argv = docs_commands()[f"runs/{run}"]
    split = argv.index("--")
    launcher, train = argv[3:split], argv[split + 1 :]
    if spares is not None:
        i = launcher.index("--spares")
        launcher[i + 1] = str(spares)
    if "--spare-command" in launcher:
        i = launcher.index("--spare-command") + 1
        spare = shlex.split(launcher[i])
        assert spare[:5] == ["nice", "-n", "19", "axplug", "train"], spare
        # Long enough to be still training when its host is taken.
        busy = ["--max-steps", "100000", "--checkpoint-every", "100000"]
        launcher[i] = shlex.join([*spare[:3], *AXPLUG, *spare[4:], *tiny_sets(cache_dir), *busy])
    assert train[:2] == ["axplug", "train"], train
    argv = [*AXPLUG, "launch", "--local", *launcher, *flags, "--",
            *AXPLUG, *train[1:], *tiny_sets(cache_dir)]  # fmt: skip
    # The session's XLA flags stay (the launcher sets each process's device count itself).
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    log = open(tmp / f"{run}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log, proc.scratch = tmp / f"{run}.log", tmp / ".axplug-hosts"
    proc.output_dir = tmp / "runs" / run
    return proc


def finish(proc, timeout=300):
    proc.wait(timeout=timeout)
    text = proc.log.read_text()
    return proc.returncode, text


def complete_steps(output_dir):
    ckpt = output_dir / "checkpoints"
    if not ckpt.exists():
        return []
    return sorted(p.name for p in ckpt.iterdir() if (p / "commit_success.txt").exists())


def kill_process_mid_run(proc, process_id=1, timeout=240):
    """SIGKILLs the trainer with `process_id` once a checkpoint is committed."""
    deadline = time.time() + timeout
    while not complete_steps(proc.output_dir):
        assert proc.poll() is None and time.time() < deadline, proc.log.read_text()[-3000:]
        time.sleep(0.01)
    hosts = json.loads((proc.scratch / "hosts.json").read_text())["hosts"]
    (pid,) = [h["pid"] for h in hosts if h["process_id"] == process_id]
    os.kill(pid, signal.SIGKILL)
    killed_at = len(read_jsonl(proc.output_dir / "metrics.jsonl"))
    assert killed_at < STEPS, f"killed after {killed_at} of {STEPS} steps: too late to test"


def final_checksums(output_dir):
    """Every state leaf's checksum at the last step: equal checksums, equal bits."""
    path = output_dir / "checkpoints" / step_dir_name(STEPS) / CHECKSUMS_ITEM / METADATA_FILE
    return json.loads(path.read_text())


def losses(output_dir):
    records = read_jsonl(output_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xla-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """An uninterrupted run of the same 2 processes x 4 devices."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = start_local(tmp, "swap", cache_dir, spares=0)
    code, text = finish(proc)
    assert code == 0, text[-3000:]
    return proc.output_dir


@pytest.mark.slow  # five trainer processes, one killed
def test_killed_trainer_is_swapped_for_a_standby_and_the_run_ends_bit_exact(
    tmp_path, cache_dir, reference
):
    proc = start_local(tmp_path, "swap", cache_dir)
    kill_process_mid_run(proc)
    code, text = finish(proc)
    assert code == 0, text[-4000:]
    # host-2's low-priority `axplug train` yields on SIGTERM: saved (75), or killed by it.
    swapped = re.escape(
        "launch: host-1 (process 1) lost (signal SIGKILL): swapped in host-2 (its low-priority "
        "job stopped: EXIT) as process 1; 0 standby left; restarting 2 processes from the "
        "newest checkpoint"
    ).replace("EXIT", "(exit 75|signal SIGTERM)")
    assert re.search(swapped, text), text[-4000:]
    assert "[host-2 standby] " in text
    recovered = re.search(r"launch: recovered: step \d+ done ([\d.]+) s after host-1 failed", text)
    assert recovered is not None, text[-4000:]
    assert float(recovered.group(1)) > 0
    hosts = {h["name"]: h for h in json.loads((proc.scratch / "hosts.json").read_text())["hosts"]}
    assert hosts["host-1"]["state"] == "retired" and hosts["host-2"]["process_id"] == 1
    # The same final parameters and optimizer state, bit for bit, and the same losses.
    assert final_checksums(proc.output_dir) == final_checksums(reference)
    assert losses(proc.output_dir) == losses(reference)


@pytest.mark.slow
def test_elastic_job_shrinks_to_one_process_and_keeps_the_losses(tmp_path, cache_dir, reference):
    proc = start_local(tmp_path, "elastic", cache_dir)
    kill_process_mid_run(proc)
    code, text = finish(proc)
    assert code == 0, text[-4000:]
    assert (
        "launch: host-1 (process 1) lost (signal SIGKILL), no standby left: --elastic continues "
        "on 1 of 2 processes, learner.grad_accumulation_steps=2 (global batch kept)" in text
    )
    assert "launch: attempt 2: 1 processes on host-0, learner.grad_accumulation_steps=2" in text
    # One process of 4 devices, two microbatches of 4 rows: the same per-device rows, the
    # same global batch, so the same losses to float32 reduction order.
    np.testing.assert_allclose(losses(proc.output_dir), losses(reference), rtol=1e-5)


@pytest.mark.slow  # 33 s: a third two-process job
def test_no_standby_left_stops_with_the_restart_code(tmp_path, cache_dir):
    proc = start_local(tmp_path, "swap", cache_dir, spares=0)
    kill_process_mid_run(proc)
    code, text = finish(proc)
    assert code == 75, text[-4000:]
    assert (
        "error: host-1 (process 1) lost (signal SIGKILL) and no standby host is left; the state "
        "is safe: rerun with more --spares, or --elastic to continue on fewer processes" in text
    )


@pytest.mark.slow
def test_elastic_job_grows_back_when_the_host_returns(tmp_path, cache_dir, reference):
    proc = start_local(tmp_path, "elastic", cache_dir, "--regrow-after", "0")
    kill_process_mid_run(proc)
    code, text = finish(proc)
    assert code == 0, text[-4000:]
    assert "launch: host-1 is healthy again and stands by" in text
    assert (
        "launch: growing from 1 to 2 processes (host-1 joined), "
        "learner.grad_accumulation_steps=1" in text
    )
    assert "launch: attempt 3: 2 processes on host-0, host-1\n" in text
    np.testing.assert_allclose(losses(proc.output_dir), losses(reference), rtol=1e-5)


def _exited(pid: int) -> bool:
    """Whether `pid` (not this process's child) has exited: gone, or a zombie."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_supervisor_takes_its_trainer_down_saved_and_the_run_dir_free(
    tmp_path, cache_dir, monkeypatch, capsys
):
    """SIGKILL of `launch --local` (an OOM kill): the trainer gets SIGTERM, saves, exits 75 and
    releases the run's lease; `axplug train` into the directory then resumes from that step."""
    monkeypatch.setattr(sys.modules[__name__], "STEPS", 100_000)  # still training when killed
    proc = start_local(tmp_path, "swap", cache_dir, "--num-processes", "1", spares=0)
    deadline = time.time() + 240
    while not complete_steps(proc.output_dir):
        assert proc.poll() is None and time.time() < deadline, proc.log.read_text()[-3000:]
        time.sleep(0.01)
    (host,) = [h for h in json.loads((proc.scratch / "hosts.json").read_text())["hosts"]
               if h["process_id"] == 0]  # fmt: skip
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while not _exited(host["pid"]):
        assert time.time() < deadline, "the trainer outlived its supervisor"
        time.sleep(0.05)
    log = (tmp_path / host["directory"] / "trainer-attempt1.log").read_text()
    saved = re.search(r"preempted at step (\d+) \(SIGTERM\): saved", log)
    assert saved is not None, log[-3000:]
    assert step_dir_name(int(saved.group(1))) in complete_steps(proc.output_dir)
    argv = ["train", "--preset", "llama-tiny", "--modifier", "mesh:fsdp=-1",
            "--output-dir", "runs/swap", *tiny_sets(cache_dir),
            "--max-steps", str(int(saved.group(1)) + 1)]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = cli_main(argv)  # in this process, which takes the run's lease
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert f"resumed from step {saved.group(1)}" in err + out

"""A checkpoint saved on 8 devices (`fsdp=8`) resumes on 4 devices, and on 2 processes of 2
devices, and one saved by 2 processes of 4 devices resumes on 1 process of 4, with the 8-device
run's losses to float32 reduction order: same global batch, same data stream."""

import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from axplug_testing import tiny_train_args, xla_flags

from axplug.summary import read_jsonl

HALF, STEPS = 6, 12


def _command(output_dir, cache_dir, max_steps):
    overrides = ("log_every=1", f"compilation_cache_dir={str(cache_dir)!r}",
                 "model.decoder.transformer.num_layers=1")  # fmt: skip
    args = tiny_train_args(output_dir, *overrides, preset="llama-tiny",
                           modifiers=["mesh:fsdp=-1"], max_steps=max_steps)  # fmt: skip
    return [sys.executable, "-m", "axplug.cli", *args, "--checkpoint-every", str(HALF)]


def _run(output_dir, cache_dir, max_steps, devices, processes=1):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices)}  # fmt: skip
    command = _command(output_dir, cache_dir, max_steps)
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    procs = [
        subprocess.Popen(command + (["--process-id", str(i)] if processes > 1 else []),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(processes)
    ]  # fmt: skip
    errs = [p.communicate(timeout=300)[1] for p in procs]
    for proc, err in zip(procs, errs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return errs[0]


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """The uninterrupted 8-device run's losses, and a copy of it stopped at HALF."""
    root = tmp_path_factory.mktemp("eight")
    cache = root / "cache"
    _run(root / "full", cache, STEPS, 8)
    _run(root / "half", cache, HALF, 8)
    losses = np.asarray([r["loss"] for r in read_jsonl(root / "full" / "metrics.jsonl")])
    # The comparisons tell batches apart: a stream shifted by a step, or rows split otherwise,
    # moves a loss far beyond the tolerance.
    assert np.all(np.abs(np.diff(losses)) > 10 * 2e-6 * losses[1:])
    return [r["loss"] for r in read_jsonl(root / "full" / "metrics.jsonl")], root / "half", cache


@pytest.mark.slow  # child processes on other meshes; test_trainer resumes onto another mesh
@pytest.mark.parametrize("devices, processes", [(4, 1), (2, 2)])
def test_an_eight_device_checkpoint_resumes_elsewhere_with_the_same_losses(
    tmp_path, eight_devices, devices, processes
):
    reference, half, cache = eight_devices
    run = tmp_path / "run"
    shutil.copytree(half, run)
    err = _run(run, cache, STEPS, devices, processes)
    assert f"resumed from step {HALF}" in err
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Steps 1..HALF are the 8-device run's own; the rest ran on the new topology.
    np.testing.assert_array_equal([r["loss"] for r in records[:HALF]], reference[:HALF])
    np.testing.assert_allclose([r["loss"] for r in records[HALF:]], reference[HALF:],
                               rtol=2e-6, atol=0)  # fmt: skip


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(tmp_path, eight_devices):
    reference, _, cache = eight_devices
    run = tmp_path / "run"
    err = _run(run, cache, HALF, 4, processes=2)
    assert "process 0 of 2" in err
    state = run / "checkpoints" / f"step_{HALF:08d}" / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state))
    err = _run(run, cache, STEPS, 4)
    assert f"resumed from step {HALF}" in err and "process 0 of" not in err
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=2e-6, atol=0)

"""Kill a real training process with SIGKILL, restart it, and get bit-identical results."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args

from axplug.checkpoint import Checkpointer
from axplug.cli.main import build_parser
from axplug.cli.train_cmd import build_config
from axplug.summary import read_jsonl

STEPS = 120


def train_args(output_dir, cache_dir, extra=()):
    cache = f"compilation_cache_dir={str(cache_dir)!r}"
    overrides = ("log_every=1", cache, "model.decoder.transformer.num_layers=1")
    args = tiny_train_args(output_dir, *overrides, max_steps=STEPS)
    return [*args, "--checkpoint-every", "10", "--seed", "3", *extra]


def start(output_dir, cache_dir, extra=()):
    return subprocess.Popen(
        [sys.executable, "-m", "axplug.cli", *train_args(output_dir, cache_dir, extra)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc):
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def records(output_dir):
    path = output_dir / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def final_params(output_dir, cache_dir, extra=()):
    args = build_parser().parse_args(train_args(output_dir, cache_dir, extra))
    trainer = build_config(args).instantiate()
    directory = str(output_dir / "checkpoints")
    with Checkpointer.default_config().set(directory=directory).instantiate() as checkpointer:
        step, state, _ = checkpointer.restore(target=trainer.layout.abstract)
    return step, jax.device_get(state)


def cache_entries(cache_dir):
    return set(os.listdir(cache_dir)) if cache_dir.exists() else set()


# Packed token files resume through the same loop as bytes, and their batches are a function
# of the step (`TokenFileInput.batch(step)`, test_token_file.py).
@pytest.fixture(params=["bytes", "packed_token_files"])
def extra(request, tmp_path):
    """The run's input: the preset's bytes, or packed token shards from `prepare-data`."""
    if request.param == "bytes":
        return ()
    pytest.importorskip("tokenizers")
    from axplug.input import bundled_corpus_path
    from axplug.input.prepare import prepare_data
    from tokenizer_files import hf_bpe

    data = tmp_path / "data"
    prepare_data([bundled_corpus_path()], tokenizer=hf_bpe(tmp_path / "tok"), output=data,
                 text_unit="paragraph", docs_per_shard=500, workers=1)  # fmt: skip
    return ("--input", f"token_file:path={str(data)!r},packing=True")


@pytest.mark.slow  # child processes killed mid-run; a signal's save runs by default
def test_sigkill_and_resume_is_bit_identical(tmp_path, extra):
    cache = tmp_path / "xla-cache"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    finish(start(reference, cache, extra))
    after_first = cache_entries(cache)
    assert after_first, "the persistent compilation cache stayed empty"

    proc = start(resumed, cache, extra)
    deadline = time.time() + 120
    while len(records(resumed)) < 25 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "training finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(records(resumed))
    assert 25 <= killed_at < STEPS
    # The same config compiled the same programs: the rerun took them all from the cache.
    assert cache_entries(cache) == after_first

    finish(start(resumed, cache, extra))
    ref, res = records(reference), records(resumed)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]  # exact, not approximate
    step_a, state_a = final_params(reference, cache, extra)
    step_b, state_b = final_params(resumed, cache, extra)
    assert step_a == step_b == STEPS
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
    assert (resumed / "config.txt").read_text() == (reference / "config.txt").read_text().replace(
        str(reference), str(resumed)
    )


@pytest.mark.slow
def test_ten_kills_at_seeded_random_times_resume_bit_identically(tmp_path):
    """Ten kills at points drawn from a seed (0.2-2 s after start: imports, restore,
    compile; or 1-25 steps on: mid-step, mid-save, mid-retention), then one run to the end:
    the same losses and parameters as an uninterrupted run."""
    import random

    cache = tmp_path / "xla-cache"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    finish(start(reference, cache))
    rng = random.Random(20261130)
    kills = 0
    for _ in range(10):
        done = len(records(killed))
        proc = start(killed, cache)
        if rng.random() < 0.3:  # early: imports, restore, compile
            time.sleep(rng.uniform(0.2, 2.0))
        else:  # a few steps on: mid-step, mid-save, mid-retention
            target = min(done + rng.randint(1, 25), STEPS - 1)
            deadline = time.time() + 120
            while len(records(killed)) < target and proc.poll() is None:
                assert time.time() < deadline, "no progress"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is not None:  # it finished first: the run is done
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 8, f"only {kills} kills landed before the run finished"
    # Then one run to the end: a kill after the last step's record may have cut its save.
    finish(start(killed, cache))
    ref, res = records(reference), records(killed)
    assert [r["step"] for r in res] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in res] == [r["loss"] for r in ref]
    step_a, state_a = final_params(reference, cache)
    step_b, state_b = final_params(killed, cache)
    assert step_a == step_b == STEPS
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)

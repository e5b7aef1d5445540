"""Checkpoint integrity: per-leaf checksums catch changed files, and resume falls back past a
latest step that fails to restore (truncated, emptied or missing files) to the one before."""

from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import pytest
from axplug_testing import tiny_train_args, tiny_trainer_config, xla_flags

from axplug.checkpoint import CheckpointCorruptError, host_checksums, tree_checksums

RUN = ("checkpoint_every=2", "model.decoder.transformer.num_layers=1", "input.seq_len=16")


def config(out, steps=4, *extra):
    return tiny_trainer_config(out, *RUN, *extra, max_steps=steps)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run with complete steps 2 and 4, and the state of each."""
    out = tmp_path_factory.mktemp("run")
    trainer = config(out).instantiate(devices=jax.devices()[:1])
    trainer.run()
    states = {}
    for step in (2, 4):
        _, state, _ = trainer.checkpointer.restore(step, target=trainer.layout.abstract)
        states[step] = jax.device_get(state)
    trainer.checkpointer.close()
    return out, states


def copy(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run[0], dest)
    return dest


def step_dir(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


def data_files(out, step):
    files = [p for p in (step_dir(out, step) / "state").rglob("*") if p.is_file()]
    return sorted((p for p in files if "/d/" in str(p)), key=lambda p: -p.stat().st_size)


def test_checksums_do_not_depend_on_sharding_and_catch_any_flipped_byte():
    mesh = jax.make_mesh((8,), ("x",))
    tree = {
        "w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 7,
        "b": np.full(16, 3, dtype=jax.numpy.bfloat16),
        "n": np.int32(7),
        "mask": np.array([True, False, True]),
    }
    sharded = dict(
        tree,
        w=jax.device_put(tree["w"], jax.sharding.NamedSharding(mesh, jax.P("x"))),
    )
    want = host_checksums(tree)
    assert tree_checksums(sharded) == tree_checksums(jax.device_put(tree)) == want
    raw = tree["w"].view(np.uint8).reshape(-1)
    for i in range(raw.size):  # every byte, every one of its bits changed: always a new sum
        changed = tree["w"].copy()
        changed.view(np.uint8).reshape(-1)[i] ^= 1 << (i % 8)
        assert host_checksums({"w": changed})["w"] != want["w"], i


def test_host_sums_and_nan_checks_run_block_by_block_and_agree_with_the_devices(monkeypatch):
    from axplug.checkpoint import checksum
    from axplug.checkpoint._tree import first_non_finite

    rng = np.random.default_rng(0)
    tree = {
        "w": rng.standard_normal((13, 5)).astype(np.float32),
        "b": rng.standard_normal(30).astype(jax.numpy.bfloat16),
        "i": np.arange(23, dtype=np.int8),
        "u": rng.integers(0, 2**32, 11, dtype=np.uint32),
        "mask": rng.random(19) > 0.5,
    }
    # The devices' program: arrays that one CPU device holds go to the host path instead.
    names = sorted(tree)
    sums = checksum._device_checksums([jax.device_put(tree[n]) for n in names])
    want = {n: f"{int(v):08x}" for n, v in zip(names, jax.device_get(sums), strict=True)}
    monkeypatch.setattr(checksum, "HOST_BLOCK", 7)  # every leaf in several blocks
    on_device = jax.device_put(tree)
    assert all(checksum.in_host_memory(x) for x in jax.tree.leaves(on_device))
    assert host_checksums(tree) == tree_checksums(on_device) == want
    late = tree["w"].copy()
    late[12, 4] = np.nan  # in the last block
    assert first_non_finite({"a": on_device["w"], "z": jax.device_put(late)}) == "['z']"
    assert first_non_finite(on_device) is None


def test_a_changed_data_file_is_never_restored_silently(run, tmp_path):
    out = copy(run, tmp_path)
    target = data_files(out, 4)[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    trainer = config(out).instantiate(devices=jax.devices()[:1])
    try:
        _, state, _ = trainer.checkpointer.restore(4, target=trainer.layout.abstract)
    except CheckpointCorruptError as exc:
        assert "step 4" in str(exc)
    else:  # the byte held nothing restored: then the values must be exactly the saved ones
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), run[1][4])
    trainer.checkpointer.close()


def test_verification_compares_every_leaf_with_what_was_saved(run, tmp_path):
    out = copy(run, tmp_path)
    trainer = config(out).instantiate(devices=jax.devices()[:1])
    saved = trainer.checkpointer.saved_checksums(4)
    assert saved == host_checksums(run[1][4])
    # As if the bytes of one leaf changed on disk: the recorded sum no longer matches.
    name = sorted(saved)[0]
    bad = dict(saved, **{name: f"{(int(saved[name], 16) + 1) % 2**32:08x}"})
    item = step_dir(out, 4) / "checksums" / "metadata"
    item.write_text(__import__("json").dumps(bad))
    with pytest.raises(CheckpointCorruptError, match=rf"step 4 .* fails verification: {name}"):
        trainer.checkpointer.restore(4, target=trainer.layout.abstract)
    trainer.checkpointer.close()


def _truncate(out):
    f = data_files(out, 4)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _zero(out):
    data_files(out, 4)[0].write_bytes(b"")


def _no_metadata(out):
    (step_dir(out, 4) / "state" / "_METADATA").unlink()


def _empty_json(out):
    (step_dir(out, 4) / "metadata" / "metadata").write_text("")


@pytest.mark.parametrize("damage", [_truncate, _zero, _no_metadata, _empty_json])
def test_resume_falls_back_past_a_corrupt_latest_step(run, tmp_path, caplog, damage):
    out = copy(run, tmp_path)
    damage(out)
    trainer = config(out, 6).instantiate(devices=jax.devices()[:1])
    with caplog.at_level(logging.WARNING, logger="axplug.trainer"):
        state = trainer.restore_or_init()
    assert int(state["step"]) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), run[1][2])
    assert "step 4" in caplog.text and "trying the step before" in caplog.text
    # The cause in a line, no TensorStore dump (axplug's records: asyncio may also log a
    # TensorStore task's traceback on its own when the read is abandoned).
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("axplug")]
    assert ours and all(len(m.splitlines()) == 1 for m in ours), ours
    assert trainer.checkpointer.all_steps() == [2]  # step 4 marked incomplete
    trainer.checkpointer.close()
    trainer = config(out, 6).instantiate(devices=jax.devices()[:1])
    trainer.run()  # trains on from 2 and saves 4 and 6 again
    assert trainer.checkpointer.all_steps() == [2, 4, 6]
    trainer.checkpointer.close()


def test_stop_policy_raises_instead(run, tmp_path):
    out = copy(run, tmp_path)
    _zero(out)
    trainer = config(out, 6, "restore.on_corrupt='stop'").instantiate(devices=jax.devices()[:1])
    with pytest.raises(CheckpointCorruptError, match="step 4"):
        trainer.restore_or_init()
    assert trainer.checkpointer.all_steps() == [2, 4]  # nothing marked
    trainer.checkpointer.close()


def test_checkpoints_verify_command(run, tmp_path, capsys):
    from axplug.cli import main

    out = copy(run, tmp_path)
    assert main(["checkpoints", "verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 2: ok (" in text and "step 4: ok (" in text
    _truncate(out)
    assert main(["checkpoints", "verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "step 2: ok" in text and "step 4: CORRUPT:" in text
    assert main(["checkpoints", "verify", str(out), "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["checkpoints", "ls", str(tmp_path / "nowhere")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err


DISK_FULL = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))  # a disk that fills at 60 kB
from axplug.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_save_reports_its_cause_once_and_leaves_no_temporary_dirs(run, tmp_path):
    """`run`'s training, by the command, in a process whose disk fills at 60 kB (the state
    is larger). On one of the session's 8 devices, after `run` compiled its programs: the
    child reads them from the session's cache (whose key holds the device count) and writes
    no entry there (one it wrote would be cut off at 60 kB)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_flags(len(jax.devices()))
    proc = subprocess.run(
        [sys.executable, "-c", DISK_FULL, *tiny_train_args(tmp_path / "run", *RUN, max_steps=4)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert err.count("error: saving step 2 to ") == 1 and "Error writing" in err
    assert "Exception ignored" not in err and "ERROR:absl" not in err
    assert "axplug/trainer" not in err  # no traceback through the trainer: the cause, once
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == []


def test_resuming_with_another_model_names_the_difference_and_keeps_every_step(run, tmp_path):
    """A changed config is not a corrupt checkpoint: nothing is marked, nothing falls back."""
    from axplug.checkpoint import CheckpointError

    out = copy(run, tmp_path)
    wider = config(out, 6, "model.decoder.dim=48").instantiate(devices=jax.devices()[:1])
    with pytest.raises(CheckpointError, match=r"step 4 .* holds a different state") as info:
        wider.restore_or_init()
    assert not isinstance(info.value, CheckpointCorruptError)
    assert "params/decoder/embedding/weight: saved float32[256, 32], here float32[256, 48]" in (
        str(info.value)
    )
    assert wider.checkpointer.all_steps() == [2, 4]  # both steps still complete
    wider.checkpointer.close()

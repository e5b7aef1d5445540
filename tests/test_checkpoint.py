"""Checkpointer: round trips, layout and completeness, retention, async saves, storage, meshes."""

import functools
import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from axplug import registry
from axplug.checkpoint import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    LocalStorage,
    Storage,
    StorageNotFoundError,
    parse_step,
    scheme_of,
    step_dir_name,
    steps_to_keep,
    storage_for,
    tree_checksums,
)
from axplug.config import RequiredFieldError


def _checkpointer(directory, **kwargs):
    return Checkpointer.default_config().set(directory=str(directory), **kwargs).instantiate()


@functools.partial(jax.jit, static_argnames="seed")  # one program per seed, not one per op
def _train_state(seed=0):
    """Nested dicts of f32/bf16/int32, an optax chain state, a raw PRNG key and a step."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "dense": {
            "w": jax.random.normal(k1, (16, 8), jnp.float32),
            "b": jax.random.normal(k2, (8,), jnp.bfloat16),
        },
        "ids": jax.random.randint(k3, (5,), -1000, 1000, jnp.int32),
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial mu, nu and count
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.PRNGKey(seed + 7),  # uint32[2]
        "step": jnp.asarray(123, jnp.int32),
    }


def _assert_same(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _abstract(tree, sharding=None):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), tree
    )


def test_round_trip_is_bit_identical_and_keeps_the_target_structure(tmp_path):
    state = _train_state()
    with _checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, state, {"loss": 1.5, "tokens": 4096, "tags": ["a"]})
        step, restored, metadata = ckpt.restore(target=_abstract(state))
    assert step == 7
    assert metadata == {"loss": 1.5, "tokens": 4096, "tags": ["a"]}
    _assert_same(restored, state)
    # NamedTuple types survive: the optimizer state is usable by optax as is.
    adam = restored["opt_state"][1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert isinstance(restored["opt_state"][0], optax.EmptyState)
    assert restored["rng"].dtype == jnp.uint32 and restored["rng"].shape == (2,)


def test_target_may_be_eval_shape_output_or_arrays(tmp_path):
    state = _train_state()
    with _checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        _, from_eval_shape, metadata = ckpt.restore(1, target=jax.eval_shape(lambda: state))
        _, from_arrays, _ = ckpt.restore(1, target=_train_state(seed=3))
    assert metadata == {}
    _assert_same(from_eval_shape, state)
    _assert_same(from_arrays, state)


def test_layout_is_one_committed_directory_per_step_and_metadata_reads_json(tmp_path):
    with _checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(3, {"x": jnp.arange(4.0)}, {"epoch": 2})
        ckpt.save(12, {"x": jnp.arange(4.0)}, {"epoch": 5})
        assert ckpt.metadata(3) == {"epoch": 2}
        assert ckpt.metadata() == {"epoch": 5}
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000012"]
    assert (tmp_path / "step_00000012" / COMMIT_MARKER).is_file()
    assert step_dir_name(12) == "step_00000012" and parse_step("step_00000012") == 12
    assert parse_step("step_00000012.orbax-checkpoint-tmp-1") is None


def test_partial_and_temporary_saves_are_never_listed_or_restored(tmp_path):
    state = {"x": jnp.arange(6.0)}
    ckpt = _checkpointer(tmp_path)
    ckpt.save(3, state, {"ok": True})
    ckpt.wait_until_finished()
    # What a crash leaves behind: orbax temp dirs, a step dir without its marker, stray files.
    (tmp_path / "step_00000009.orbax-checkpoint-tmp").mkdir()
    (tmp_path / "step_00000009.orbax-checkpoint-tmp-1700000000").mkdir()
    (tmp_path / "step_00000010" / "state").mkdir(parents=True)
    (tmp_path / "step_00000011.orbax-checkpoint-tmp").mkdir()
    (tmp_path / "step_00000011.orbax-checkpoint-tmp" / COMMIT_MARKER).write_text("renamed next")
    (tmp_path / "notes.txt").write_text("not a step")
    assert ckpt.all_steps() == [3]
    assert ckpt.latest_step() == 3
    assert ckpt.restore(target=_abstract(state))[0] == 3
    with pytest.raises(CheckpointNotFoundError, match=r"step 10 is incomplete .* steps: 3$"):
        ckpt.restore(10, target=_abstract(state))
    with pytest.raises(CheckpointNotFoundError, match=r"step 4 is missing .* steps: 3$"):
        ckpt.metadata(4)
    # Saving a step that was left incomplete replaces the leftover.
    ckpt.save(10, state, {"ok": "again"})
    ckpt.close()
    with _checkpointer(tmp_path) as reopened:
        assert reopened.all_steps() == [3, 10]
        assert reopened.metadata(10) == {"ok": "again"}


def test_retention_keeps_the_last_n_and_every_kth(tmp_path):
    with _checkpointer(tmp_path, keep_last=3, keep_every=4) as ckpt:
        for step in range(1, 11):
            ckpt.save(step, {"x": jnp.full((3,), step, jnp.int32)}, {"step": step})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [4, 8, 9, 10]
        _, state, metadata = ckpt.restore(4, target={"x": jax.ShapeDtypeStruct((3,), jnp.int32)})
    assert metadata == {"step": 4} and state["x"].tolist() == [4, 4, 4]
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(s) for s in (4, 8, 9, 10)]


def test_steps_to_keep():
    steps = range(1, 11)
    assert steps_to_keep(steps, 3, None) == {8, 9, 10}
    assert steps_to_keep(steps, 3, 4) == {4, 8, 9, 10}
    assert steps_to_keep(steps, 1, 5) == {5, 10}
    assert steps_to_keep([], 3, 2) == set()


@pytest.fixture
def gated_finalize(monkeypatch):
    """Holds every background save just before it commits, until the event is set."""
    gate = threading.Event()
    original = ocp.CompositeCheckpointHandler.finalize

    def finalize(self, directory):
        gate.wait(timeout=60)
        return original(self, directory)

    monkeypatch.setattr(ocp.CompositeCheckpointHandler, "finalize", finalize)
    yield gate
    gate.set()


def test_save_returns_before_the_write_completes(tmp_path, gated_finalize):
    big = {"w": jnp.arange(1 << 20, dtype=jnp.float32), "v": jnp.ones((512, 1024), jnp.float32)}
    expected = jax.tree.map(np.asarray, big)
    ckpt = _checkpointer(tmp_path)
    gated_finalize.set()
    ckpt.save(1, big, {"n": 1})
    ckpt.wait_until_finished()
    gated_finalize.clear()

    ckpt.save(2, big, {"n": 2})  # ~8 MB: copied off device, written in the background
    assert ckpt.latest_step() == 1  # not committed while the writer is held
    for leaf in jax.tree.leaves(big):
        leaf.delete()  # the saved copy no longer depends on the device buffers
    # A second save waits for the first to commit.
    second = threading.Thread(target=ckpt.save, args=(3, {"w": jnp.zeros(2)}))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()
    gated_finalize.set()
    second.join(timeout=60)
    assert not second.is_alive()
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [1, 2, 3]
    _, restored, metadata = ckpt.restore(
        2, target=_abstract(expected, SingleDeviceSharding(jax.devices()[0]))
    )
    ckpt.close()
    assert metadata == {"n": 2}
    _assert_same(restored, expected)


def test_non_finite_state_is_refused_and_nothing_is_written(tmp_path):
    ckpt = _checkpointer(tmp_path)
    state = _train_state()
    bad = jax.tree.map(lambda x: x, state)
    bad["params"]["dense"]["b"] = bad["params"]["dense"]["b"].at[3].set(jnp.nan)
    with pytest.raises(ValueError, match=r"step 5 .*\['params'\]\['dense'\]\['b'\] .*non-finite"):
        ckpt.save(5, bad)
    bad = jax.tree.map(lambda x: x, state)
    bad["opt_state"][1][0].nu["dense"]["w"] = (
        bad["opt_state"][1][0].nu["dense"]["w"].at[0].set(jnp.inf)
    )
    with pytest.raises(ValueError, match=r"step 6 .*\.nu\['dense'\]\['w'\]"):
        ckpt.save(6, bad)
    with pytest.raises(ValueError, match="step 7: metadata is not JSON-serializable"):
        ckpt.save(7, state, {"x": object()})
    ckpt.close()
    assert os.listdir(tmp_path) == []


def test_restore_errors_name_the_directory_and_the_steps(tmp_path):
    missing = tmp_path / "never-written"
    with _checkpointer(missing) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        with pytest.raises(CheckpointNotFoundError, match=f"no complete checkpoint in {missing}"):
            ckpt.restore(target={"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
        ckpt.save(2, {"x": jnp.zeros(2)})
        with pytest.raises(CheckpointNotFoundError, match=r"step 5 is missing .* steps: 2$"):
            ckpt.restore(5, target={"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
        with pytest.raises(CheckpointError, match="step 2 already has a complete checkpoint"):
            ckpt.save(2, {"x": jnp.zeros(2)})
        with pytest.raises(
            CheckpointError, match=rf"step 2 in {missing} holds a different state .*missing here: x"
        ) as info:
            ckpt.restore(2, target={"y": jax.ShapeDtypeStruct((2,), jnp.float32)})
        assert not isinstance(info.value, CheckpointCorruptError)  # a mismatch, not damage
    with pytest.raises(CheckpointError, match="is closed"):
        ckpt.save(3, {"x": jnp.zeros(2)})


def test_config_is_validated(tmp_path):
    with pytest.raises(RequiredFieldError, match="directory: required field is not set"):
        Checkpointer.default_config().instantiate()
    with pytest.raises(ValueError, match="keep_last: must be at least 1"):
        _checkpointer(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every: must be None or at least 1"):
        _checkpointer(tmp_path, keep_every=0)
    with pytest.raises(ValueError, match="data_file_bytes: must be None or at least 1, got 0"):
        _checkpointer(tmp_path, data_file_bytes=0)


def _data_files(step_dir):
    return [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]


def test_data_file_bytes_splits_the_arrays_into_files_that_restore_exactly(tmp_path):
    state = _train_state()
    key = jax.random.PRNGKey(1)
    state["big"] = {f"w{i}": jax.random.normal(key, (64, 256)) + i for i in range(8)}  # 64 KiB
    with _checkpointer(tmp_path, data_file_bytes=32 * 1024) as ckpt:
        ckpt.save(1, state)
        _, restored, _ = ckpt.restore(1, target=_abstract(state))
        assert ckpt.verify(1) == len(jax.tree.leaves(state))
    _assert_same(restored, state)
    # A file is closed once it passes 32 KiB: no file holds two big arrays (~60 KiB compressed
    # each), so there are at least 8 files. (Orbax's default, 2 GiB, puts arrays written
    # together into one file.) Writes run concurrently, so where an array's bytes land varies.
    sizes = sorted(p.stat().st_size for p in _data_files(tmp_path / step_dir_name(1)))
    assert len(sizes) >= 8 and sizes[-1] < 80 * 1024, sizes


def test_one_checkpointer_saves_and_restores_whole_and_partial_states(tmp_path):
    # Orbax takes one handler type per item and instance: a partial restore after a save (or a
    # save after one) used to fail as if the step were corrupt.
    state = _train_state()
    with _checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        _, params, _ = ckpt.restore(1, target={"params": _abstract(state["params"])}, partial=True)
        ckpt.save(2, state)
        _, restored, _ = ckpt.restore(2, target=_abstract(state))
    _assert_same(params, {"params": state["params"]})
    _assert_same(restored, state)


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def test_restore_from_one_device_onto_an_8_device_mesh_and_back(tmp_path):
    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 fake CPU devices"
    mesh = _mesh()
    one = SingleDeviceSharding(jax.devices()[0])
    state = {
        "w": jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), one),
        "e": jax.device_put(jnp.arange(8 * 4, dtype=jnp.bfloat16).reshape(8, 4), one),
        "count": jax.device_put(jnp.asarray(3, jnp.int32), one),
    }
    shardings = {
        "w": NamedSharding(mesh, PartitionSpec("data", "model")),
        "e": NamedSharding(mesh, PartitionSpec("data", None)),
        "count": NamedSharding(mesh, PartitionSpec()),
    }
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in state.items()
    }
    with _checkpointer(tmp_path / "a") as ckpt:
        ckpt.save(1, state)
        _, sharded, _ = ckpt.restore(target=target)
    for k in state:
        assert sharded[k].sharding == shardings[k]
    assert len(sharded["w"].addressable_shards) == 8
    assert sharded["w"].addressable_shards[0].data.shape == (2, 8)
    _assert_same(sharded, state)

    with _checkpointer(tmp_path / "b") as ckpt:
        ckpt.save(1, sharded)
        _, single, _ = ckpt.restore(target=_abstract(state, one))
    for k in state:
        assert single[k].sharding == one
    _assert_same(single, state)


def test_small_replicated_arrays_save_whole_without_a_program_per_replica(tmp_path):
    """Orbax writes a replicated array in one slice per replica, which compiles a slicing
    program per replica and shape; arrays too small for that to pay are written whole."""
    replicated = NamedSharding(_mesh(), PartitionSpec())
    shapes = [(8 * (i + 1), 37) for i in range(4)]  # shapes no other test slices
    state = {
        f"a{i}": jax.device_put(np.full(s, i, np.float32), replicated) for i, s in enumerate(shapes)
    }
    tree_checksums(state)  # the save's checksum programs, compiled before counting
    compiles = []

    def count(event, _secs, **_):
        compiles.append(event == "/jax/core/compile/backend_compile_duration")

    with _checkpointer(tmp_path) as ckpt:
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            ckpt.save(1, state)
            ckpt.wait_until_finished()
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        _, restored, _ = ckpt.restore(target=_abstract(state, replicated))
    # The save's non-finite check is one program; slicing was one per replica and array (32).
    assert sum(compiles) == 1
    _assert_same(restored, state)


def test_storage_is_chosen_by_url_scheme():
    assert scheme_of("/tmp/x") == "file" and scheme_of("file:///tmp/x") == "file"
    assert scheme_of("S3://bucket/run") == "s3" and scheme_of("relative/dir") == "file"
    local = storage_for("/tmp/x")
    assert isinstance(local, LocalStorage) and isinstance(storage_for("file:///tmp/x"), Storage)
    assert str(local.path("file:///tmp/x/step_00000001")) == "/tmp/x/step_00000001"
    assert local.join("s3://b/run/", "step_00000001", "state") == "s3://b/run/step_00000001/state"
    assert "file" in registry.names("storage")


def test_unknown_scheme_names_the_plugin_to_install_without_importing_it(
    tmp_path, plugin_site, monkeypatch
):
    # plugin_site shows only the core; forget the cloud plugin if an earlier test imported it.
    for name in [m for m in sys.modules if m.startswith("axplug_checkpoint_cloud")]:
        monkeypatch.delitem(sys.modules, name)
    expected = "no storage backend for scheme 's3' (url s3://b/x): install the plugin that"
    with pytest.raises(StorageNotFoundError) as info:
        storage_for("s3://b/x")
    assert str(info.value).startswith(expected)
    with pytest.raises(StorageNotFoundError, match="scheme 'gs'"):
        _checkpointer("gs://bucket/run/checkpoints")
    with pytest.raises(StorageNotFoundError, match="entry point group axplug.storage"):
        storage_for("weird://x")
    assert not any(m.startswith("axplug_checkpoint_cloud") for m in sys.modules)


MEM_STORAGE = """
import os
from axplug.checkpoint import LocalStorage


class MemStorage(LocalStorage):
    # An object store stand-in: mem://NAME lives under `root`, committed by marker file.
    atomic_rename = False

    def __init__(self, root):
        self.root = root

    def _local(self, url):
        return os.path.join(self.root, url[len("mem://"):])
"""


def test_a_plugin_backend_is_found_by_scheme_and_commits_with_a_marker(tmp_path, plugin_site):
    plugin_site.add(
        "fake-mem-storage",
        {"axplug.storage": {"mem": "fake_mem_storage:MemStorage"}},
        modules={"fake_mem_storage": MEM_STORAGE},
    )
    state = _train_state()
    root = tmp_path / "bucket"
    with _checkpointer("mem://run/ckpt", storage_options={"root": str(root)}) as ckpt:
        assert type(ckpt.storage).__name__ == "MemStorage"
        ckpt.save(1, state, {"where": "mem"})
        ckpt.wait_until_finished()
        _, restored, metadata = ckpt.restore(target=_abstract(state))
    assert metadata == {"where": "mem"}
    _assert_same(restored, state)
    assert (root / "run" / "ckpt" / "step_00000001" / COMMIT_MARKER).is_file()


CRASHING_SAVER = """
import os, sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
from axplug.checkpoint import CheckpointError, Checkpointer

ckpt = Checkpointer.default_config().set(directory=sys.argv[1]).instantiate()
state = {"x": jnp.arange(1000.0)}
ckpt.save(1, state, {"n": 1})
ckpt.wait_until_finished()

def failing_finalize(self, directory):
    raise OSError("disk full (injected)")

original = ocp.CompositeCheckpointHandler.finalize
ocp.CompositeCheckpointHandler.finalize = failing_finalize
ckpt.save(2, state, {"n": 2})
try:
    ckpt.wait_until_finished()
except CheckpointError as exc:
    print("ERROR:", exc, flush=True)
print("STEPS:", ckpt.all_steps(), flush=True)

def hang(self, directory):
    os._exit(0)  # the process dies mid-save, before the commit

ocp.CompositeCheckpointHandler.finalize = hang
ckpt.save(3, state, {"n": 3})
ckpt.wait_until_finished()
print("UNREACHABLE", flush=True)
"""


def test_failed_and_killed_saves_leave_the_last_complete_step(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVER, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "ERROR: saving step 2 to" in proc.stdout and "OSError: disk full (injected)" in proc.stdout
    )
    assert "STEPS: [1]" in proc.stdout and "UNREACHABLE" not in proc.stdout
    leftovers = set(os.listdir(directory)) - {"step_00000001"}
    assert leftovers and all(".orbax-checkpoint-tmp" in name for name in leftovers)

    with _checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [1]
        target = {"x": jax.ShapeDtypeStruct((1000,), jnp.float32)}
        step, state, metadata = ckpt.restore(target=target)
        assert (step, metadata) == (1, {"n": 1})
        np.testing.assert_array_equal(state["x"], np.arange(1000.0, dtype=np.float32))
        ckpt.save(2, state, {"n": 2})  # the same steps save again over the leftovers
        ckpt.save(3, state, {"n": 3})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2, 3]
        assert json.loads(json.dumps(ckpt.metadata(3))) == {"n": 3}

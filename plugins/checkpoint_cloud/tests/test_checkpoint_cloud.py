"""axplug-checkpoint-cloud against real S3 and GCS servers on 127.0.0.1 (moto, s3rver, fake-gcs)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_checkpoint_cloud import GcsStorage, S3Storage
from axplug_testing import StorageConformance, tiny_train_args, tiny_trainer_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from axplug.api.checkpoint import (
    COMMIT_MARKER,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    list_steps,
    step_dir_name,
    storage_for,
)
from axplug.api.summary import read_jsonl
from object_stores import (
    S3RVER_KEY,
    create_gcs_bucket,
    create_s3_bucket,
    fake_gcs_server,
    free_port,
    moto_server,
    wait_for_gcs_bucket,
)

FAST_RETRIES = {"max_retries": 1, "retry_initial_delay_s": 0.05, "retry_max_delay_s": 0.2}


def s3_options(server, **extra):
    return {"endpoint": server.url, **FAST_RETRIES, "timeout_s": 5.0, **extra}


def _checkpointer(directory, options, **kwargs):
    cfg = Checkpointer.default_config().set(directory=directory, storage_options=options, **kwargs)
    return cfg.instantiate()


def _state(seed=0, n=64):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w": jax.random.normal(k1, (n, 8), jnp.float32),
        "b": jax.random.normal(k2, (8,), jnp.bfloat16),
        "step": jnp.asarray(seed, jnp.int32),
    }


def _abstract(state, sharding=None):
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- conformance kit -------------------------------------------------------------------------


# The kit's checkpoint check builds its own Checkpointer from the URL alone, so these backends
# find their server through the standard environment variables.
class TestS3StorageConformance(StorageConformance):
    @pytest.fixture
    def storage(self, moto, monkeypatch):
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
        return S3Storage()

    @pytest.fixture
    def root_url(self, s3_bucket):
        return f"s3://{s3_bucket}/root"


class TestGcsStorageConformance(StorageConformance):
    @pytest.fixture
    def storage(self, gcs_server, monkeypatch):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
        return GcsStorage()

    @pytest.fixture
    def root_url(self, gcs_bucket):
        return f"gs://{gcs_bucket}/root"


# -- checkpoints -----------------------------------------------------------------------------


def test_schemes_resolve_to_the_plugin_backends():
    assert isinstance(storage_for("s3://b/x"), S3Storage)
    assert isinstance(storage_for("gs://b/x"), GcsStorage)
    assert isinstance(storage_for("gcs://b/x"), GcsStorage)
    assert str(GcsStorage().path("gcs://bkt/a/b")) == "gs://bkt/a/b"


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_async_save_restore_is_bit_exact_and_onto_another_mesh(backend, request):
    if backend == "s3":
        server, bucket = request.getfixturevalue("moto"), request.getfixturevalue("s3_bucket")
        options = s3_options(server)
    else:
        server, bucket = (
            request.getfixturevalue("gcs_server"),
            request.getfixturevalue("gcs_bucket"),
        )
        options = {"endpoint": server.url, **FAST_RETRIES}
    directory = f"{backend}://{bucket}/run/checkpoints"
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharded = NamedSharding(mesh, PartitionSpec("data", None))
    state = _state(1)
    state["w"] = jax.device_put(state["w"], sharded)
    with _checkpointer(directory, options, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, state), {"step": step})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3]
        names = ckpt.storage.listdir(directory)
        assert step_dir_name(1) not in names, "retention must delete step 1"
    # A fresh checkpointer (a new process would do the same) restores onto one device.
    with _checkpointer(directory, options) as ckpt:
        step, restored, metadata = ckpt.restore(target=_abstract(state))
        assert step == 3 and metadata == {"step": 3}
        _assert_same(restored, jax.tree.map(lambda x: x + 3, state))
        # ... and onto the other mesh axis.
        other = NamedSharding(mesh, PartitionSpec(None, "model"))
        target = _abstract(state)
        target["w"] = jax.ShapeDtypeStruct(state["w"].shape, jnp.float32, sharding=other)
        _, resharded, _ = ckpt.restore(2, target=target)
        assert resharded["w"].sharding == other
        _assert_same(resharded, jax.tree.map(lambda x: x + 2, state))


def test_partial_step_is_never_restored_and_is_replaced_on_resave(moto, s3_bucket):
    directory = f"s3://{s3_bucket}/ckpt"
    with _checkpointer(directory, s3_options(moto)) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait_until_finished()
        partial = ckpt.storage.join(directory, step_dir_name(2))
        ckpt.storage.write_text(ckpt.storage.join(partial, "state", "half"), "x")
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        infos = {i.step: i for i in ckpt.step_infos(sizes=True)}
        assert infos[2].complete is False and infos[1].complete is True
        assert infos[1].size_bytes > 64 * 8 * 4 and infos[1].mtime > time.time() - 600
        ckpt.save(2, _state(2))
        ckpt.wait_until_finished()
        assert not ckpt.storage.exists(ckpt.storage.join(partial, "state", "half"))
        _, restored, _ = ckpt.restore(target=_abstract(_state()))
        ckpt.delete(1)
        assert ckpt.all_steps() == [2] and not ckpt.storage.exists(f"{directory}/step_00000001")
        with pytest.raises(CheckpointNotFoundError, match="step 1 does not exist"):
            ckpt.delete(1)
    _assert_same(restored, _state(2))


def test_retention_deletes_the_completion_marker_first(moto, s3_bucket):
    directory = f"s3://{s3_bucket}/ckpt"
    with _checkpointer(directory, s3_options(moto), keep_last=1) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.wait_until_finished()
        deleted = []
        real_delete = ckpt.storage.delete
        ckpt.storage.delete = lambda url: (deleted.append(url), real_delete(url))[1]
        ckpt.save(2, _state(2))
        ckpt.wait_until_finished()
    step1 = f"{directory}/{step_dir_name(1)}"
    assert deleted[-2:] == [f"{step1}/{COMMIT_MARKER}", step1]


def test_secrets_are_refused_in_config_and_absent_from_what_is_written(moto, s3_bucket):
    with pytest.raises(ValueError, match="credentials are never taken from the config"):
        S3Storage(endpoint=moto.url, secret_access_key="hunter2")
    with pytest.raises(ValueError, match="no credentials in the URL"):
        S3Storage(endpoint="http://user:pw@127.0.0.1:1")
    with pytest.raises(TypeError, match="unknown s3 storage options"):
        S3Storage(endpoint=moto.url, bucket_region="x")
    directory = f"s3://{s3_bucket}/ckpt"
    with _checkpointer(directory, s3_options(moto)) as ckpt:
        ckpt.save(1, _state(1), {"note": "ok"})
        ckpt.wait_until_finished()
        fs = ckpt.storage.fs
        blobs = b"".join(fs.cat_file(p) for p in fs.find(f"{s3_bucket}/ckpt"))
    assert S3RVER_KEY.encode() not in blobs and b"AWS_SECRET" not in blobs


def test_missing_bucket_is_a_clear_error_naming_it(moto):
    with pytest.raises(CheckpointError, match=r"bucket 'no-such-bucket-x'.*does not exist"):
        _checkpointer("s3://no-such-bucket-x/run", s3_options(moto))


def test_unreachable_server_fails_fast_before_training():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"cannot reach the server.*{url}|{url}.*reach"):
        _checkpointer("s3://some-bucket/run", {"endpoint": url, **FAST_RETRIES, "timeout_s": 2})
    assert time.monotonic() - start < 30


def test_axplug_train_against_a_dead_server_fails_before_training(monkeypatch, axplug_cli):
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    result = axplug_cli(
        "train", "--preset", "gpt-tiny", "--output-dir", "s3://dead-bucket/run",
        "--set", "checkpointer.storage_options={'max_retries': 0, 'timeout_s': 2}",
    )  # fmt: skip
    assert result.exit_code != 0
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert re.search(rf"bucket 'dead-bucket' at {url}.*cannot reach", line), result.stderr
    assert "step" not in result.stdout  # it failed before training


def test_wrong_credentials_are_a_clear_error_naming_the_bucket(tmp_path, monkeypatch):
    server = moto_server(check_auth=True).start(tmp_path)  # knows no access key at all
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOT-A-KNOWN-KEY")
        with pytest.raises(CheckpointError, match=r"bucket 'creds-bucket'.*access denied"):
            _checkpointer("s3://creds-bucket/run", s3_options(server))
    finally:
        server.stop()


# -- the server dies mid-save ----------------------------------------------------------------

SAVER = textwrap.dedent(
    """
    import json, os, sys
    import jax.numpy as jnp
    from axplug.checkpoint import Checkpointer, CheckpointError

    directory, options = sys.argv[1], json.loads(sys.argv[2])
    cfg = Checkpointer.default_config().set(directory=directory, storage_options=options)
    ckpt = cfg.instantiate()
    ckpt.save(1, {"w": jnp.arange(1000.0)})
    ckpt.wait_until_finished()
    print("SAVED 1", flush=True)
    ckpt.save(2, {"w": jnp.ones((64, 1024, 1024), jnp.float32)})  # 256 MB: a save that lasts
    print("SAVING 2", flush=True)
    try:
        ckpt.wait_until_finished()
        print("NO ERROR", flush=True)
    except CheckpointError as exc:
        print("ERROR", exc, flush=True)
    sys.stdin.readline()  # the server is back: the next checkpoint must work again
    ckpt.save(3, {"w": jnp.arange(1000.0) * 3})
    ckpt.wait_until_finished()
    print("SAVED 3", flush=True)
    os._exit(0)  # orbax threads of the failed save may delay a normal exit
    """
)


def _wait_for_line(proc, prefix, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if line.startswith("NO ERROR"):  # the save outran the kill; the saver now waits on stdin
            break
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no {prefix!r} from the saver:\n{proc.stderr.read()[-3000:]}")


# The GCS variant takes ~35 s (the 256 MB upload to fake-gcs-server and gcsfs's own retries).
# The s3 variant needs npm (s3rver is installed from the npm registry on first use), so the
# default run kills an in-memory moto server instead: same failure, but a restart empties it.
@pytest.fixture(
    params=[
        "s3-memory",
        pytest.param("s3", marks=pytest.mark.slow),
        pytest.param("gs", marks=pytest.mark.slow),
    ]
)
def disk_store(request, tmp_path, monkeypatch):
    """(server, its data dir or None when in memory, checkpoint directory URL, storage options)."""
    if request.param == "s3-memory":
        server = moto_server().start(tmp_path)
        request.addfinalizer(server.stop)
        create_s3_bucket(server.url, "fault-bucket")
        return server, None, "s3://fault-bucket/run/checkpoints", s3_options(server)
    if request.param == "s3":
        server = request.getfixturevalue("s3rver")
        create_s3_bucket(server.url, "fault-bucket")
        data, options = tmp_path / "s3rver-data", s3_options(server)
    else:
        data = tmp_path / "gcs-data"
        server = fake_gcs_server(data).start(tmp_path)
        request.addfinalizer(server.stop)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", server.url)
        create_gcs_bucket(server.url, "fault-bucket")
        options = {"endpoint": server.url, **FAST_RETRIES, "timeout_s": 5.0}
    return server, data, f"{request.param}://fault-bucket/run/checkpoints", options


def test_server_killed_mid_save_fails_clearly_and_nothing_committed_is_lost(disk_store, tmp_path):
    server, data, directory, options = disk_store
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, directory, json.dumps(options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_line(proc, "SAVED 1")
        _wait_for_line(proc, "SAVING 2")
        deadline = time.monotonic() + 60
        # In memory there is nothing to watch: kill at once (save() has made the step's
        # directories and returned; the 256 MB upload runs in the background).
        while data and time.monotonic() < deadline and not any(data.rglob("*step_00000002*")):
            time.sleep(0.02)
        server.kill()
        error = _wait_for_line(proc, "ERROR", timeout=120)
        assert f"saving step 2 to {directory}/step_00000002" in error
        server.start(tmp_path)  # same directory and port: the committed data is still there
        if directory.startswith("gs://"):
            wait_for_gcs_bucket(server, "fault-bucket")
        if data is None:  # in memory: the restarted server is empty, nothing to restore
            create_s3_bucket(server.url, "fault-bucket")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            _wait_for_line(proc, "SAVED 3", timeout=120)
            with _checkpointer(directory, options) as ckpt:
                assert ckpt.all_steps() == [3]
            return
        with _checkpointer(directory, options) as ckpt:
            assert ckpt.all_steps() == [1], "the interrupted step 2 must never count"
            infos = {i.step: i.complete for i in ckpt.step_infos()}
            assert infos.get(2, False) is False
            _, restored, _ = ckpt.restore(target={"w": jax.ShapeDtypeStruct((1000,), jnp.float32)})
            np.testing.assert_array_equal(restored["w"], np.arange(1000.0, dtype=np.float32))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _wait_for_line(proc, "SAVED 3", timeout=120)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with _checkpointer(directory, options) as ckpt:
        assert ckpt.all_steps() == [1, 3]


# -- the trainer's save-failure policy and resuming from a bucket ----------------------------


def _tiny_trainer(output_dir, *extra, steps=4):
    overrides = ("checkpoint_every=2", "model.decoder.transformer.num_layers=1", *extra)
    return tiny_trainer_config(output_dir, *overrides, max_steps=steps)


@pytest.mark.parametrize("policy", ["retry_next", "stop"])
def test_trainer_save_failure_policy(tmp_path, policy, caplog):
    trainer = _tiny_trainer(str(tmp_path), f"saving.on_error={policy!r}", steps=6).instantiate()
    storage, real_path = trainer.checkpointer.storage, trainer.checkpointer.storage.path

    def path(url):  # the store refuses the write of step 2
        if url.endswith(step_dir_name(2)):
            raise ConnectionError(f"injected: store down while writing {url}")
        return real_path(url)

    storage.path = path
    if policy == "stop":
        with pytest.raises(CheckpointError, match=r"saving step 2 to .*step_00000002 failed"):
            trainer.run()
        assert trainer.checkpointer.all_steps() == []
        return
    trainer.run()
    assert trainer.checkpointer.all_steps() == [4, 6]
    assert any("saving step 2" in r.getMessage() for r in caplog.records)


def test_a_store_outage_during_a_save_is_ridden_out_or_ends_75_and_resumes(
    s3rver, tmp_path, monkeypatch, caplog
):
    """The store's server stops as step 4 is saved: back within `outage_s`, the save is made
    again and the run ends as an uninterrupted one would; gone for longer, the run raises
    StoreOutageError (exit 75) and its rerun resumes from step 2 to the same state."""
    from axplug.api.checkpoint import StoreOutageError

    create_s3_bucket(s3rver.url, "outage")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3rver.url)

    def run(url, outage_s, *, stop_at=None, back_after_s=None):
        options = {**FAST_RETRIES, "outage_s": outage_s}
        trainer = _tiny_trainer(url, f"checkpointer.storage_options={options!r}", steps=6)
        trainer = trainer.instantiate()
        saver, real_save = trainer.saver, trainer.saver.save
        storage = saver.checkpointer.storage
        real_is_outage, restarting = storage.is_outage, []

        def save(state, step, **kwargs):  # the server stops as `stop_at` is saved
            if step == stop_at and s3rver.proc.poll() is None:
                saver.checkpointer.wait_until_finished()  # the outage meets this step's save
                s3rver.kill()
            return real_save(state, step, **kwargs)

        def is_outage(exc):  # the server comes back `back_after_s` after the first failure
            outage = real_is_outage(exc)
            if outage and back_after_s is not None and not restarting:
                restarting.append(threading.Timer(back_after_s, s3rver.start, (tmp_path,)))
                restarting[0].start()
            return outage

        saver.save, storage.is_outage = save, is_outage
        trainer.run()
        with trainer.checkpointer as ckpt:
            return ckpt.all_steps(), ckpt.restore(target=trainer.layout.abstract)[1]

    steps, ridden_out = run("s3://outage/ride", 60.0, stop_at=4, back_after_s=0.5)
    assert steps[-2:] == [4, 6]
    assert any("saving again for up to 60 s" in r.getMessage() for r in caplog.records)

    with pytest.raises(StoreOutageError, match=r"saving step 4 .* no answer for 2 s") as info:
        run("s3://outage/stop", 2.0, stop_at=4)
    assert info.value.exit_code == 75 and "rerun the command to resume" in str(info.value)
    s3rver.start(tmp_path)
    steps, resumed = run("s3://outage/stop", 2.0)
    assert steps[-2:] == [4, 6]
    _assert_same(resumed, ridden_out)


def test_trainer_config_rejects_unknown_save_policy(tmp_path):
    with pytest.raises(ValueError, match=r"saving.on_error: must be one of"):
        _tiny_trainer(str(tmp_path), "saving.on_error='ignore'").instantiate()


def _final_state(cfg):
    trainer = cfg.instantiate()
    trainer.run()
    with trainer.checkpointer as ckpt:
        return ckpt.restore(target=trainer.layout.abstract)


def test_trainer_resumes_from_s3_bit_identically(moto, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    url = f"s3://{s3_bucket}/run"
    step, reference, _ = _final_state(_tiny_trainer(str(tmp_path / "local")))
    _final_state(_tiny_trainer(url, steps=2))
    resumed_step, resumed, metadata = _final_state(_tiny_trainer(url))
    assert step == resumed_step == 4 and metadata["step"] == 4
    _assert_same(resumed, reference)
    assert "S3RVER" not in json.dumps(metadata)


# -- `axplug checkpoints` --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_checkpoints_ls_and_rm(backend, tmp_path, request, monkeypatch, capsys):
    from axplug_testing import cli_main as main

    if backend == "local":
        run = str(tmp_path / "run")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("moto").url)
        run = f"s3://{request.getfixturevalue('s3_bucket')}/run"
    directory = f"{run}/checkpoints"
    with _checkpointer(directory, None, keep_last=5) as ckpt:
        for step in (4, 8):
            ckpt.save(step, _state(step))
        ckpt.wait_until_finished()
        ckpt.storage.write_text(f"{directory}/{step_dir_name(12)}/state/partial", "x")
    assert main(["checkpoints", "ls", run]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("4", "complete"),
        ("8", "complete"),
        ("12", "incomplete"),
    ]
    assert rows[0][3] in ("kB", "MB") and float(rows[0][2]) > 0
    assert main(["checkpoints", "ls", directory, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12] and records[0]["size_bytes"] > 2048
    assert main(["checkpoints", "rm", run, "--step", "8"]) == 2  # the latest complete one
    assert "pass --force" in capsys.readouterr().err
    assert main(["checkpoints", "rm", run, "--step", "8", "--force"]) == 0
    assert "deleted step 8" in capsys.readouterr().out
    assert [i.step for i in list_steps(storage_for(directory), directory)] == [4, 12]
    assert main(["checkpoints", "rm", run, "--step", "8"]) == 1
    assert "step 8 does not exist" in capsys.readouterr().err


# -- end to end: `axplug train` into a bucket whose server is killed and restarted -----------


def _axplug(*args, env, cwd):
    proc = subprocess.run(
        [sys.executable, "-m", "axplug.cli", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_axplug_train_into_s3_resumes_bit_identically_after_a_server_restart(
    s3rver, tmp_path, monkeypatch
):
    from axplug_testing import train_config

    create_s3_bucket(s3rver.url, "e2e-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3rver.url)
    home = tmp_path / "home"  # summaries of a bucket run go to ~/.cache/axplug/runs/...
    env = {**os.environ, "HOME": str(home)}
    env.pop("AXPLUG_CACHE")  # the session's: here the run's own home cache is the point
    env.pop("XDG_CACHE_HOME", None)
    cache = f"compilation_cache_dir={str(tmp_path / 'xla')!r}"

    def train(output_dir, max_steps):
        args = tiny_train_args(output_dir, cache, preset="llama-tiny", max_steps=max_steps)
        args += ["--checkpoint-every", "4"]
        _axplug(*args, env=env, cwd=tmp_path)
        return args

    url = "s3://e2e-bucket/run"
    train(url, 4)
    s3rver.kill()
    s3rver.start(tmp_path)
    args = train(url, 8)
    reference = str(tmp_path / "reference")
    train(reference, 8)

    listing = _axplug("checkpoints", "ls", url, env=env, cwd=tmp_path)
    rows = [line.split()[:2] for line in listing.splitlines()[2:]]
    assert rows == [["4", "complete"], ["8", "complete"]], listing
    config = storage_for(url).read_text(f"{url}/config.txt")
    assert S3RVER_KEY not in config
    mirror = home / ".cache/axplug/runs/s3/e2e-bucket/run"
    logged = [r["step"] for r in read_jsonl(mirror / "metrics.jsonl") if "loss" in r]
    assert logged[-1] == 8

    trainer = train_config(args[1:]).instantiate()
    states = []
    for directory in (f"{url}/checkpoints", f"{reference}/checkpoints"):
        with _checkpointer(directory, None) as ckpt:
            step, state, _ = ckpt.restore(target=trainer.layout.abstract)
        assert step == 8
        states.append(jax.device_get(state))
    _assert_same(*states)


# -- the run directory's lease in a bucket ----------------------------------------------------


def test_a_bucket_run_dir_has_one_live_lease(moto, s3_bucket, monkeypatch):
    from axplug.api.run import RunDirLockedError, StoreLease

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    storage, run = S3Storage(), f"s3://{s3_bucket}/run"
    first = StoreLease(storage, run, ttl_s=2.0, settle_s=0.1)
    first.acquire()
    record = json.loads(storage.read_text(f"{run}/.axplug-lease.json"))
    assert record["pid"] == os.getpid() and record["token"] == first.token
    second = StoreLease(storage, run, ttl_s=2.0, settle_s=0.1)
    start = time.monotonic()
    with pytest.raises(RunDirLockedError, match=rf"output_dir {run} is in use by another run"):
        second.acquire()  # it waited out one ttl while the first kept renewing
    assert time.monotonic() - start >= 2.0
    first.release()
    assert not storage.exists(f"{run}/.axplug-lease.json")
    with StoreLease(storage, run, ttl_s=2.0, settle_s=0.1):  # released: free at once
        pass
    # A holder that died (stopped renewing, never released): its lease lapses after ttl_s.
    crashed = StoreLease(storage, run, ttl_s=2.0, settle_s=0.1)
    crashed.acquire()
    crashed._stop.set()
    crashed._thread.join()
    start = time.monotonic()
    with StoreLease(storage, run, ttl_s=2.0, settle_s=0.1) as taker:
        assert json.loads(storage.read_text(f"{run}/.axplug-lease.json"))["token"] == taker.token
    assert 0.5 <= time.monotonic() - start < 6.0

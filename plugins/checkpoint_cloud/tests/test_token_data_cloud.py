"""Token data in S3 and GCS (moto and fake-gcs-server on 127.0.0.1): `prepare-data --output URL`
writes the local dataset's bytes, and training from the bucket equals training from disk."""

import contextlib
import json
import threading

import jax
import numpy as np
import pytest
from axplug_testing import cli_main as main
from axplug_testing import tiny_trainer_config

from axplug.api.checkpoint import storage_for
from axplug.api.data import TokenFileInput, bundled_corpus_path
from object_stores import S3RVER_KEY, create_gcs_bucket, create_s3_bucket, unique_bucket


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request):
    """(a fresh bucket's URL, the environment that points the backend at its server)."""
    if request.param == "s3":
        url, bucket = request.getfixturevalue("moto").url, unique_bucket("s3")
        env = {"AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1"}
        env |= {"AWS_ACCESS_KEY_ID": S3RVER_KEY, "AWS_SECRET_ACCESS_KEY": S3RVER_KEY}
        with _environment(env):
            create_s3_bucket(url, bucket)
        return f"s3://{bucket}", env
    url, bucket = request.getfixturevalue("gcs_server").url, unique_bucket("gs")
    create_gcs_bucket(url, bucket)
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
    return f"gs://{bucket}", env | {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@contextlib.contextmanager
def _environment(env):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        yield


@pytest.fixture
def bucket_url(store, monkeypatch):
    """The module's bucket, the environment pointing the backend at its server."""
    url, env = store
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return url


def _prepare(output, staging):
    return main(["prepare-data", str(bundled_corpus_path()), "--tokenizer", "bytes",
                 "--text-unit", "paragraph", "--docs-per-shard", "400", "--workers", "1",
                 "--output", str(output), "--staging", str(staging)])  # fmt: skip


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    """The data prepared on disk: the same for every bucket."""
    local = tmp_path_factory.mktemp("data") / "local"
    assert _prepare(local, local.parent / "unused") == 0
    return local


@pytest.fixture(scope="module")
def prepared(local_data, store, tmp_path_factory):
    """The same data prepared into the bucket, once per store (the tests only read it)."""
    url, env = store
    staging = tmp_path_factory.mktemp("staging") / "staging"
    with _environment(env):
        assert _prepare(f"{url}/data/corpus", staging) == 0
    assert not staging.exists()  # uploaded, then removed
    return f"{url}/data/corpus"


@pytest.fixture
def datasets(local_data, prepared, bucket_url):
    """(local directory, URL) of the same prepared data."""
    return local_data, prepared


def test_prepare_data_into_a_bucket_writes_the_local_files(datasets):
    local, url = datasets
    storage = storage_for(url)
    meta = json.loads(storage.read_text(f"{url}/meta.json"))
    assert len(meta["shards"]) > 2
    assert storage.read_text(f"{url}/meta.json") == (local / "meta.json").read_text()
    for shard in meta["shards"]:
        for suffix in (".bin", ".docs.npy"):
            name = shard["name"] + suffix
            assert storage.read_bytes(f"{url}/{name}") == (local / name).read_bytes(), name


def _batches(path, **extra):
    cfg = TokenFileInput.default_config().set(path=str(path), seq_len=64, batch_size=4, seed=1,
                                              **extra)  # fmt: skip
    data = cfg.instantiate()
    return [b for _, (_, b) in zip(range(6), data.iter_from(3), strict=False)]


@pytest.mark.parametrize("extra", [{"packing": True}, {"rows": "documents", "prefetch": 0}])
def test_batches_from_the_bucket_equal_the_local_ones(datasets, extra):
    local, url = datasets
    for a, b in zip(_batches(local, **extra), _batches(url, **extra), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def _trainer(output_dir, data):
    cfg = tiny_trainer_config(output_dir, f"input.path={str(data)!r}", max_steps=4,
                              preset="gpt-tiny")  # fmt: skip
    cfg.input = TokenFileInput.default_config().set(path=str(data), seq_len=32, batch_size=8)
    return cfg.instantiate()


@pytest.fixture(scope="module")
def trained_from_disk(local_data, tmp_path_factory):
    """The parameters trained from the data on disk."""
    trainer = _trainer(tmp_path_factory.mktemp("disk"), local_data)
    trainer.run()
    return jax.tree.leaves(jax.device_get(trainer.state["params"]))


def test_training_from_the_bucket_equals_training_from_disk(
    datasets, trained_from_disk, tmp_path, monkeypatch
):
    _, url = datasets
    from_bucket = _trainer(tmp_path, url)
    storage_type, readers = type(storage_for(url)), []
    read_bytes = storage_type.read_bytes

    def recording(self, path, *byte_range):
        if path.endswith(".bin"):
            readers.append(threading.current_thread().name)
        return read_bytes(self, path, *byte_range)

    monkeypatch.setattr(storage_type, "read_bytes", recording)  # after the shards' spot checks
    from_bucket.run()
    flat_a = trained_from_disk
    flat_b = jax.tree.leaves(jax.device_get(from_bucket.state["params"]))
    assert len(flat_a) == len(flat_b) > 4
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(a, b)
    # The step does not wait on the bucket: every token read of the run is a prefetching thread's.
    assert readers and all(name.startswith("axplug-input") for name in readers), readers


def test_a_missing_bucket_dataset_is_one_error_naming_it(bucket_url):
    cfg = TokenFileInput.default_config().set(path=f"{bucket_url}/no/such/data")
    with pytest.raises(Exception, match="is not a prepared data directory") as info:
        cfg.instantiate()
    assert f"{bucket_url}/no/such/data" in str(info.value)


def test_a_store_outage_past_its_budget_exits_75_and_the_rerun_resumes_exactly(
    s3rver, tmp_path, monkeypatch, capsys
):
    """Data read from a bucket whose server stops: reads wait `outage_s`, then the run exits
    75 (restart me) with its state safe; restarted with the server back, it ends where an
    uninterrupted run ends, bit for bit."""
    import time

    from axplug_checkpoint_cloud import StoreOutageError
    from axplug_testing import tiny_train_args

    from axplug.api.run import RESTART_EXIT_CODE
    from axplug.api.summary import read_jsonl

    create_s3_bucket(s3rver.url, "outage")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3rver.url)
    url = "s3://outage/data"
    corpus = tmp_path / "corpus.txt"  # small: the test is about the outage, not the data
    corpus.write_text(bundled_corpus_path().read_text()[:200_000])
    assert (
        main(
            [
                "prepare-data",
                str(corpus),
                "--tokenizer",
                "bytes",
                "--text-unit",
                "paragraph",
                "--workers",
                "1",
                "--output",
                url,
                "--staging",
                str(tmp_path / "staging"),
            ]
        )
        == 0
    )
    # No client retries inside a read: the outage's 2 s are the run's own waiting.
    options = {"outage_s": 2.0, "max_retries": 0}
    spec = f"token_file:path={url!r},storage_options={options!r},prefetch=0"

    def argv(out):
        args = tiny_train_args(out, "log_every=1", max_steps=6)
        return [*args, "--input", spec, "--checkpoint-every", "2"]

    assert main(argv(tmp_path / "reference")) == 0
    capsys.readouterr()

    def stop_after_step_3():
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and len(read_jsonl(metrics)) >= 3):
            time.sleep(0.05)
        s3rver.kill()

    watcher = threading.Thread(target=stop_after_step_3, daemon=True)
    watcher.start()
    assert main(argv(tmp_path / "run")) == RESTART_EXIT_CODE == StoreOutageError.exit_code
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert (
        "cannot reach the server" in line and "no answer for 2 s (storage option outage_s)" in line
    )
    assert "rerun the command to resume" in line
    watcher.join()

    s3rver.start(tmp_path)
    assert main(argv(tmp_path / "run")) == 0
    ref, run = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("reference", "run"))
    losses = {r["step"]: r["loss"] for r in run if "loss" in r}  # the steps redone log twice
    assert [losses[r["step"]] for r in ref if "loss" in r] == [
        r["loss"] for r in ref if "loss" in r
    ]
    assert max(losses) == 6

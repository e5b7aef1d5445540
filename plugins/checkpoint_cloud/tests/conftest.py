"""The object-store servers (started once per session on 127.0.0.1, stopped by PID) and a
fresh bucket per test, shared by this distribution's test modules."""

import pytest

from object_stores import (
    S3RVER_KEY,
    create_gcs_bucket,
    create_s3_bucket,
    fake_gcs_server,
    moto_server,
    s3rver_server,
    unique_bucket,
)

# -- servers and buckets ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    server = moto_server().start(tmp_path_factory.mktemp("moto-log"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    server = fake_gcs_server().start(tmp_path_factory.mktemp("gcs-log"))
    yield server
    server.stop()


@pytest.fixture
def s3rver(tmp_path):
    """A disk-backed S3 server of this test only, in tmp_path/s3rver-data."""
    server = s3rver_server(tmp_path / "s3rver-data").start(tmp_path)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch):
    # s3rver checks signatures against its fixed key; moto accepts any key.
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3RVER_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3RVER_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture
def s3_bucket(moto):
    bucket = unique_bucket("s3")
    create_s3_bucket(moto.url, bucket)
    return bucket


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch):
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs_server.url)
    bucket = unique_bucket("gs")
    create_gcs_bucket(gcs_server.url, bucket)
    return bucket

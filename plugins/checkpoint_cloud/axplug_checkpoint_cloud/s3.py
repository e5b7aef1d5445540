"""`S3Storage`: checkpoints in S3 or an S3-compatible server, written by tensorstore's s3 driver."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from axplug.api.config import ConfigTypeError, ConfigValueError
from axplug_checkpoint_cloud import _orbax_routes
from axplug_checkpoint_cloud.object_store import (
    DEFAULT_OUTAGE_S,
    ObjectStorage,
    RetryBudget,
    forget_epath_filesystems,
    reject_secrets,
)

if TYPE_CHECKING:
    import fsspec
    from etils import epath

__all__ = ["S3Storage"]

_DEFAULT_REGION = "us-east-1"


class S3Storage(ObjectStorage):
    """`s3://bucket/key` URLs: arrays through tensorstore's s3 driver, the rest through s3fs.

    Every setting defaults to the standard AWS environment: `AWS_ENDPOINT_URL_S3` or
    `AWS_ENDPOINT_URL`, `AWS_REGION` or `AWS_DEFAULT_REGION`, and the credentials of
    `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (or a profile). tensorstore ignores
    `AWS_ENDPOINT_URL`, so the endpoint is passed to it explicitly. Options given in the
    checkpointer config (`storage_options`) override the environment; credentials are only
    ever named by source (`profile`, `credentials_file`), so no secret reaches config.txt,
    logs or checkpoint metadata.
    """

    scheme = "s3"

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        credentials_file: str | None = None,
        anonymous: bool = False,
        max_retries: int = 4,
        retry_initial_delay_s: float = 0.2,
        retry_max_delay_s: float = 2.0,
        timeout_s: float = 30.0,
        outage_s: float = DEFAULT_OUTAGE_S,
        **unknown: Any,
    ):
        reject_secrets("s3", unknown, ())
        if unknown:
            raise ConfigTypeError(
                f"unknown s3 storage options {sorted(unknown)}; known: endpoint, region, "
                "profile, credentials_file, anonymous, max_retries, retry_initial_delay_s, "
                "retry_max_delay_s, timeout_s, outage_s"
            )
        endpoint = (
            endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        if endpoint and "@" in endpoint.partition("://")[2].partition("/")[0]:
            raise ConfigValueError("s3 storage option endpoint: put no credentials in the URL")
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.region = (
            region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or _DEFAULT_REGION
        )
        self.profile = profile
        self.credentials_file = credentials_file
        self.anonymous = anonymous
        self.retries = RetryBudget(max_retries, retry_initial_delay_s, retry_max_delay_s)
        self.timeout_s = timeout_s
        if not outage_s >= 0:
            raise ConfigValueError(f"storage option outage_s: {outage_s} must be >= 0 seconds")
        self.outage_s = float(outage_s)
        self._fs = None

    def __repr__(self) -> str:
        return f"S3Storage(endpoint={self.endpoint_name!r}, region={self.region!r})"

    @property
    def endpoint_name(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region})"

    @property
    def credentials_source(self) -> str:
        if self.anonymous:
            return "anonymous"
        if self.profile or self.credentials_file:
            return f"profile {self.profile or 'default'} of {self.credentials_file or '~/.aws'}"
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the default AWS chain"

    def _fs_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "anon": self.anonymous,
            "client_kwargs": {"region_name": self.region},
            "config_kwargs": {
                "connect_timeout": self.timeout_s,
                "read_timeout": self.timeout_s,
                "retries": {"max_attempts": self.retries.max_retries + 1, "mode": "standard"},
            },
            "use_listings_cache": False,
        }
        if self.endpoint:
            options["endpoint_url"] = self.endpoint
        if self.profile:
            options["profile"] = self.profile
        return options

    def _new_filesystem(self) -> fsspec.AbstractFileSystem:
        import s3fs

        if self.credentials_file:
            # botocore reads the shared credentials file's path from the environment only.
            os.environ["AWS_SHARED_CREDENTIALS_FILE"] = self.credentials_file
        return s3fs.S3FileSystem(skip_instance_cache=True, **self._fs_options())

    def _tensorstore_spec(self) -> dict[str, Any]:
        if self.anonymous:
            credentials: dict[str, Any] = {"type": "anonymous"}
        elif self.profile or self.credentials_file:
            credentials = {"type": "profile", "profile": self.profile or "default"}
            if self.credentials_file:
                credentials["credentials_file"] = self.credentials_file
        elif os.environ.get("AWS_ACCESS_KEY_ID"):
            # Named directly: the default chain first looks for ~/.aws files and logs each miss.
            credentials = {"type": "environment"}
        else:
            credentials = {"type": "default"}
        spec: dict[str, Any] = {
            "aws_region": self.region,
            "aws_credentials": credentials,
            "s3_request_retries": self.retries.tensorstore(),
        }
        if self.endpoint:
            spec["endpoint"] = self.endpoint
        return spec

    def _orbax_path(self, url: str) -> epath.Path:
        import fsspec
        from etils import epath

        bucket, _ = self.split(url)
        _orbax_routes.register_bucket("s3", bucket, self._tensorstore_spec())
        # orbax's small files go through epath, which builds its s3 filesystem from fsspec's
        # config once; point that at this endpoint (one S3 endpoint per process for orbax).
        fsspec.config.conf["s3"] = self._fs_options()
        forget_epath_filesystems()
        return epath.Path(url)

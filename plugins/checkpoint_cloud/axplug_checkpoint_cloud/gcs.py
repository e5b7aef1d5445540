"""`GcsStorage`: checkpoints in Google Cloud Storage or a GCS-compatible server (`gs://`)."""

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

__all__ = ["GcsStorage"]


class GcsStorage(ObjectStorage):
    """`gs://bucket/key` (or `gcs://`) URLs: arrays through orbax's native GCS path, the rest
    through gcsfs.

    The endpoint defaults to `STORAGE_EMULATOR_HOST` (GCS itself when unset); tensorstore is
    pointed at the same server through `TENSORSTORE_GCS_HTTP_URL`. Credentials come from the
    Google default chain, or from `credentials_file` (a path, never the key itself).
    """

    scheme = "gs"

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        project: str | None = None,
        credentials_file: str | None = None,
        anonymous: bool | None = None,
        max_retries: int = 4,
        retry_initial_delay_s: float = 0.2,
        retry_max_delay_s: float = 2.0,
        timeout_s: float = 30.0,
        outage_s: float = DEFAULT_OUTAGE_S,
        **unknown: Any,
    ):
        reject_secrets("gs", unknown, ())
        if unknown:
            raise ConfigTypeError(
                f"unknown gs storage options {sorted(unknown)}; known: endpoint, project, "
                "credentials_file, anonymous, max_retries, retry_initial_delay_s, "
                "retry_max_delay_s, timeout_s, outage_s"
            )
        endpoint = endpoint or os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint and "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        if endpoint and "@" in endpoint.partition("://")[2].partition("/")[0]:
            raise ConfigValueError("gs storage option endpoint: put no credentials in the URL")
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.project = project
        self.credentials_file = credentials_file
        # An emulator takes no credentials; the real service needs them.
        self.anonymous = self.endpoint is not None if anonymous is None else anonymous
        self.retries = RetryBudget(max_retries, retry_initial_delay_s, retry_max_delay_s)
        self.timeout_s = timeout_s
        if not outage_s >= 0:
            raise ConfigValueError(f"storage option outage_s: {outage_s} must be >= 0 seconds")
        self.outage_s = float(outage_s)
        self._fs = None

    def __repr__(self) -> str:
        return f"GcsStorage(endpoint={self.endpoint_name!r})"

    @property
    def schemes(self) -> tuple[str, ...]:
        return ("gs", "gcs")

    @property
    def endpoint_name(self) -> str:
        return self.endpoint or "Google Cloud Storage"

    @property
    def credentials_source(self) -> str:
        if self.anonymous:
            return "anonymous"
        return self.credentials_file or "the Google default credential chain"

    def _fs_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "token": "anon" if self.anonymous else (self.credentials_file or None),
            "use_listings_cache": False,
            "timeout": self.timeout_s,
        }
        if self.endpoint:
            options["endpoint_url"] = self.endpoint
        if self.project:
            options["project"] = self.project
        return options

    def _new_filesystem(self) -> fsspec.AbstractFileSystem:
        if self.endpoint:
            # gcsfs's bucket-type probe waits 60 s per bucket on an emulator; read on import.
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self._fs_options())

    def _orbax_path(self, url: str) -> epath.Path:
        import fsspec
        from etils import epath

        bucket, key = self.split(url)
        _orbax_routes.register_bucket(
            "gs", bucket, {"gcs_request_retries": self.retries.tensorstore()}
        )
        if self.endpoint:
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.endpoint
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        if self.credentials_file:
            os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = self.credentials_file
        fsspec.config.conf["gcs"] = self._fs_options()
        forget_epath_filesystems()
        # orbax knows only gs:// as GCS.
        return epath.Path(f"gs://{bucket}/{key}" if key else f"gs://{bucket}")

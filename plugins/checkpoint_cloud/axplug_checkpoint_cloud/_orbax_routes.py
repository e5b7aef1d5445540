"""Routes orbax's tensorstore writes for `s3://` to tensorstore's `s3` driver, with a retry budget.

orbax 0.12 builds every kvstore spec itself and sends any scheme but `gs://` to the local
`file` driver, so `s3://bucket/x` would land in a local directory named `s3:`. This module
wraps the three helpers that decide that (`_normalize_path`, `_use_gcs_driver` and
`gcs_utils.get_kvstore_for_gcs`): `s3://` paths get an `s3` spec with the endpoint, region,
credentials source and retry budget that the S3 backend registered for their bucket, and
`gs://` paths get the GCS backend's retry budget. Every other path is left to orbax. Nothing
secret is ever in these specs: credentials are named by source (environment, profile), never
by value.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["register_bucket", "install", "ORBAX_RANGE"]

ORBAX_RANGE = "orbax-checkpoint>=0.12,<0.13"

_lock = threading.Lock()
_installed = False
# (scheme, bucket) -> extra members of the tensorstore kvstore spec for that bucket.
_buckets: dict[tuple[str, str], dict[str, Any]] = {}


def register_bucket(scheme: str, bucket: str, spec: dict[str, Any]) -> None:
    """Makes orbax's tensorstore writes under `scheme://bucket/` use `spec`'s members."""
    install()
    with _lock:
        _buckets[(scheme, bucket)] = dict(spec)


def _split(path: str, scheme: str) -> tuple[str, str]:
    bucket, _, key = path[len(scheme) + 3 :].partition("/")
    return bucket, key


def install() -> None:
    """Wraps orbax's kvstore-spec helpers once per process; idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            from orbax.checkpoint._src.path import gcs_utils
            from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

            normalize = ts_utils._normalize_path
            use_remote = ts_utils._use_gcs_driver
            gcs_spec = gcs_utils.get_kvstore_for_gcs
        except (ImportError, AttributeError) as exc:
            import orbax.checkpoint as ocp

            raise ImportError(
                f"axplug-checkpoint-cloud needs {ORBAX_RANGE} (installed: "
                f"{getattr(ocp, '__version__', 'unknown')}): its kvstore-spec helpers were "
                f"not found ({exc}); install a version in that range"
            ) from exc

        def normalize_path(path: str) -> str:
            if path.startswith("s3://"):
                # os.path.normpath would fold `s3://` into `s3:/`.
                return "s3://" + os.path.normpath(path[len("s3://") :])
            return normalize(path)

        def use_remote_driver(directory: str) -> bool:
            return directory.startswith("s3://") or use_remote(directory)

        def kvstore_spec(path: Any) -> dict[str, Any]:
            text = str(path)
            if text.startswith("s3://"):
                bucket, key = _split(text, "s3")
                extra = _buckets.get(("s3", bucket))
                if extra is None:
                    raise ValueError(
                        f"no S3 settings registered for bucket {bucket!r} (path {text}): "
                        "write through axplug_checkpoint_cloud.S3Storage.path()"
                    )
                return {"driver": "s3", "bucket": bucket, "path": key, **extra}
            spec = gcs_spec(path)
            if text.startswith("gs://"):
                spec.update(_buckets.get(("gs", spec.get("bucket", "")), {}))
            return spec

        ts_utils._normalize_path = normalize_path
        ts_utils._use_gcs_driver = use_remote_driver
        gcs_utils.get_kvstore_for_gcs = kvstore_spec
        _installed = True

"""axplug-checkpoint-cloud: asynchronous checkpoints in S3 (`s3://`) and GCS (`gs://`).

Importing this package registers nothing by side effect: the core finds the backends through
the `axplug.storage` entry points in pyproject.toml.
"""

from axplug_checkpoint_cloud.gcs import GcsStorage
from axplug_checkpoint_cloud.object_store import ObjectStorage, RetryBudget, StoreOutageError
from axplug_checkpoint_cloud.s3 import S3Storage

__all__ = ["S3Storage", "GcsStorage", "ObjectStorage", "RetryBudget", "StoreOutageError"]

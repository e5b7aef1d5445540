"""Asynchronous, config-built Orbax checkpoints of a training state, on pluggable storage."""

from axplug.checkpoint.checkpointer import Checkpointer
from axplug.checkpoint.checksum import host_checksums, tree_checksums
from axplug.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StorageNotFoundError,
    StoreOutageError,
)
from axplug.checkpoint.frozen import (
    ALLOW_CHANGED_BASE_ENV,
    FROZEN_KEY,
    params_digest,
    prune,
    restore_params,
)
from axplug.checkpoint.inventory import (
    StepInfo,
    checkpoint_directory,
    delete_step,
    list_steps,
    resolve_checkpoint_dir,
)
from axplug.checkpoint.layout import (
    CHECKSUMS_ITEM,
    COMMIT_MARKER,
    METADATA_FILE,
    parse_step,
    step_dir_name,
    steps_to_keep,
)
from axplug.checkpoint.local_tier import LocalTier
from axplug.checkpoint.storage import LocalStorage, Storage, scheme_of, storage_for

__all__ = [
    "FROZEN_KEY",
    "ALLOW_CHANGED_BASE_ENV",
    "params_digest",
    "prune",
    "restore_params",
    "Checkpointer",
    "LocalTier",
    "Storage",
    "LocalStorage",
    "storage_for",
    "scheme_of",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "tree_checksums",
    "host_checksums",
    "StorageNotFoundError",
    "StoreOutageError",
    "COMMIT_MARKER",
    "CHECKSUMS_ITEM",
    "METADATA_FILE",
    "step_dir_name",
    "parse_step",
    "steps_to_keep",
    "StepInfo",
    "list_steps",
    "delete_step",
    "resolve_checkpoint_dir",
    "checkpoint_directory",
]

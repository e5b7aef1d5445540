"""Grain input for axplug: `--input grain:paths=[...]` trains on token documents in
ArrayRecord or Parquet files through a Grain pipeline (global shuffle per epoch, per-process
sharding), packed like the token-file input and resumed from the iterator's saved state."""

from axplug_grain.input import STATE_FORMAT, GrainInput
from axplug_grain.packing import PackedWindowsIterDataset
from axplug_grain.sources import DocumentSource, write_array_record, write_parquet

__all__ = [
    "GrainInput",
    "STATE_FORMAT",
    "PackedWindowsIterDataset",
    "DocumentSource",
    "write_array_record",
    "write_parquet",
]

"""Hugging Face `datasets` as `axplug prepare-data` sources (`axplug.data_sources`): `hf:SPEC`
streams a Hub dataset, a local dataset directory or data files through a loader (`json`,
`csv`, `parquet`, `text`, `arrow`); `hf-disk:DIR` (and a directory source) reads a dataset
saved by `save_to_disk`. `datasets` is imported when a source is first read."""

from axplug_hf_datasets.sources import (
    LOADERS,
    HubSpec,
    disk_documents,
    hub_documents,
    parse_disk_spec,
    parse_hub_spec,
)

__all__ = [
    "LOADERS",
    "HubSpec",
    "hub_documents",
    "disk_documents",
    "parse_hub_spec",
    "parse_disk_spec",
]

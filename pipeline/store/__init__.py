"""The feature store, format v1: sharded Arrow + Zarr files with a manifest. See docs/store-format.md."""
from pipeline.store.errors import StoreConflictError, StoreError, StoreFormatError, StoreNotFoundError
from pipeline.store.format import SCHEMA_VERSION, compute_dataset_id
from pipeline.store.reader import FeatureStore, open_store
from pipeline.store.verify import VerifyReport, verify_store
from pipeline.store.writer import (begin_store, commit_manifest, committed_shards, store_identity, write_head_bytes,
                                   write_rejects, write_shard, write_store)

__all__ = [
    "SCHEMA_VERSION", "FeatureStore", "StoreConflictError", "StoreError", "StoreFormatError",
    "StoreNotFoundError", "VerifyReport", "begin_store", "commit_manifest", "committed_shards",
    "compute_dataset_id", "open_store", "store_identity", "verify_store", "write_head_bytes", "write_rejects",
    "write_shard", "write_store",
]

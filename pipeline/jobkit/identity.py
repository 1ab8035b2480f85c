"""The digest of what a job's output depends on.

A rerun with the same identity resumes (or finds the work done); any change of target, settings or input
bytes gives another identity, which the job refuses to mix with the old output unless told to replace it.
A feature store's identity is its dataset_id (`pipeline.store.compute_dataset_id`, fixed by the store
format); a job writing plain files hashes its facts with `identity_sha256`.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def identity_sha256(facts: dict[str, Any]) -> str:
    """sha256 of `facts` as sorted-key JSON. Outputs already written record this digest, so its form (json
    defaults, sort_keys) must not change: a change would make every finished output look foreign."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

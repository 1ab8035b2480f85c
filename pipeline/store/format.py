"""Format v1 of the feature store: constants, path rules, dtype encoding and the dataset fingerprint.

Nothing here imports torch: a store must be readable with pyarrow, zarr and numpy alone.
See docs/store-format.md for the layout this module encodes.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
import ml_dtypes
import numpy as np

from pipeline.store.errors import StoreFormatError
from pipeline.store.hashing import DEFAULT_CHECKSUM, new_digest, update_from_stream

SCHEMA_VERSION = "1.0"
# Bump when the meaning of stored bytes changes; part of every dataset_id.
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
LOCK = "_lock"  # local stores: flock-ed by the one job writing the store
LOCK_OBJECT = "_lock.json"  # object stores: the writing job's claim, with a lease (object_lock.py)
PENDING = "_pending.json"  # written when a store is started; names the dataset_id being built
HEAD = "head.safetensors"
REJECTS = "rejects.jsonl"
SHARDS_DIR = "shards"
SHARD_INFO = "shard.json"  # written last inside a shard directory: its commit marker
SAMPLES_FILE = "samples.arrow"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def hidden_array_name(layer: int) -> str:
    """Zarr array name for one captured layer (HF hidden_states index, negative allowed)."""
    return f"hidden_states/layer_{layer}".replace("layer_-", "layer_m")


# Logical dtype -> (numpy storage dtype, bytes per element). bf16 is kept as its uint16 bit pattern.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float8_e4m3": np.dtype("u1"),  # e4m3fn codes; a float32 scale per token lives beside (see fp8.py)
    "int8": np.dtype("i1"),  # symmetric codes -127..127; a float32 scale per token beside (see quantized.py)
}
LOSSY_DTYPES = {"float8_e4m3", "int8"}
# Logical dtype -> the numpy dtype readers hand out: the same bytes, viewed (never converted) as the real
# type. numpy has no bfloat16 or float8 of its own; ml_dtypes' are the ones JAX, TensorStore and ONNX use,
# so `.astype(np.float32)` on a returned array converts values, not bit patterns. zarr 3.1 has no such data
# types (docs/store-format.md), so the files keep uint16 / uint8 and an attribute naming the logical dtype.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "int8": np.dtype("i1"),
}


# Codecs a writer may apply to hidden-state arrays (zarr's own, so any zarr reads them): none, or zstd at
# level 1 (levels 1-9 within 1.5% of each other in size on real states; level 1 the fastest, ~900 MB/s a core).
COMPRESSIONS = ("none", "zstd")


@dataclass(frozen=True)
class StoreEncoding:
    """How a store keeps its states: the logical dtype and the codec. The lossy dtypes (float8_e4m3, int8)
    with zstd are the small stores (docs/store-format.md, "Encodings")."""

    dtype: str = "bfloat16"
    compression: str = "none"

    def __post_init__(self) -> None:
        storage_dtype(self.dtype)
        if self.compression not in COMPRESSIONS:
            raise StoreFormatError(f"compression {self.compression!r}: use one of {', '.join(COMPRESSIONS)}")

    @property
    def codec(self) -> str | None:
        """The writer's `compression` argument (None: raw)."""
        return None if self.compression == "none" else self.compression


def scale_array_name(layer: int) -> str:
    """Zarr array name of the per-token scales of an fp8 layer."""
    return hidden_array_name(layer) + "_scale"


def storage_dtype(logical: str) -> np.dtype:
    try:
        return STORAGE_DTYPES[logical]
    except KeyError:
        raise StoreFormatError(
            f"unsupported hidden-state dtype {logical!r}; use one of {sorted(STORAGE_DTYPES)}") from None


def numpy_dtype(logical: str) -> np.dtype:
    """The typed numpy dtype readers return for a `logical` store dtype (ml_dtypes for bf16 and fp8)."""
    storage_dtype(logical)  # the one error for an unknown name
    return NUMPY_DTYPES[logical]


def typed_view(stored: Any, logical: str) -> np.ndarray:
    """Stored bytes (uint16 bf16 bits, uint8 e4m3fn codes, native floats) as their typed dtype, zero-copy:
    a view of the same memory (a memory map stays one)."""
    return np.asanyarray(stored).view(numpy_dtype(logical))


def storage_view(values: Any, logical: str) -> np.ndarray:
    """An array as the storage dtype of `logical`. For bf16 and the coded dtypes (fp8, int8), whose values
    no cast can make, a typed (ml_dtypes) or already stored array is viewed, zero-copy, and any other dtype
    refused: converting float32 would round or need a scale, and a uint16 array of values (not bits) would
    be garbage. Native floats are cast by value (no copy when already in the storage dtype)."""
    array = np.asanyarray(values)
    want = storage_dtype(logical)
    if array.dtype in (NUMPY_DTYPES[logical], want):
        return array.view(want)
    if logical != "bfloat16" and logical not in LOSSY_DTYPES:
        return array.astype(want, copy=False)
    kind = "codes" if logical in LOSSY_DTYPES else "bit pattern"
    typed = NUMPY_DTYPES[logical]
    name = f"ml_dtypes.{typed.name}" if typed.type.__module__.startswith("ml_dtypes") else typed.name
    given = f"{want} {kind}" if typed == want else f"{name} or their {want} {kind}"
    raise StoreFormatError(
        f"{logical} hidden states must be {given} "
        f"(got {array.dtype}); write torch tensors through pipeline.extract.state_encoding")


def to_storage_array(values: np.ndarray, logical: str) -> np.ndarray:
    """Check and cast a numpy array to the exact bytes a store keeps for `logical` dtype.

    bf16 arrives as ml_dtypes.bfloat16 or as its uint16 bit pattern (viewed, never rounded); the torch side
    (`pipeline.extract.state_encoding`) makes that view, so the store itself never needs torch.
    """
    if logical in LOSSY_DTYPES:
        raise StoreFormatError(f"{logical} states are encoded with their scales by the writer, not here")
    return storage_view(values, logical)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def compute_dataset_id(identity: dict[str, Any]) -> str:
    """Content hash over everything that determines a store's bytes (model, tokenizer, capture, data).

    The format version is folded in so that a change of semantics changes every id.
    """
    payload = {"format_version": FORMAT_VERSION, **identity}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def safe_relpath(path: str, *, where: str) -> str:
    """Accept only a plain relative path inside the store; refuse `..`, absolute paths and URLs."""
    if not isinstance(path, str) or not path or "://" in path or path.startswith(("/", "\\")) \
            or "\\" in path or ":" in path.split("/")[0]:
        raise StoreFormatError(f"{where}: file path {path!r} is not a relative path inside the store; "
                               "the manifest is corrupt or hostile, do not use this store")
    normalized = posixpath.normpath(path)
    if normalized.startswith("..") or normalized != path:
        raise StoreFormatError(f"{where}: file path {path!r} leaves the store directory; "
                               "the manifest is corrupt or hostile, do not use this store")
    return path


def open_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a local path or fsspec URL into (filesystem, root path without trailing slash)."""
    fs, root = fsspec.core.url_to_fs(str(url))
    return fs, root.rstrip("/") or "/"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in np.atleast_1d(fs.protocol)


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def file_checksum(fs: fsspec.AbstractFileSystem, path: str, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """Hex digest of a file on `fs` (pipeline/store/hashing.py says which algorithms a store may name)."""
    with fs.open(path, "rb") as handle:
        return update_from_stream(new_digest(algorithm), handle).hexdigest()


def major_version(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise StoreFormatError(f"schema_version {version!r} is not of the form MAJOR.MINOR") from None


# Every top-level key a v1 manifest holds (writer.commit_manifest and store_identity write them); verify
# notes any other (a hand edit, a newer writer): readers ignore it, so it changes nothing they read.
MANIFEST_KEYS = frozenset({"schema_version", "format_version", "dataset_id", "target", "tokenizer", "capture",
                           "source", "hidden_size", "layers", "dtype", "counts", "shards", "files", "extra"})

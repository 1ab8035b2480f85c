"""Zarr v3 arrays for hidden states: written sharded and chunked along tokens, read by memory map.

Each layer of a shard is one Zarr array `[tokens, hidden]` whose single Zarr shard file holds
uncompressed inner chunks of `chunk_tokens` rows. Plain zarr reads it anywhere (over fsspec it fetches
only the inner chunks a read touches). On a local disk, when the inner chunks lie back to back (as the
writer lays them out), the reader maps the file and hands out zero-copy views instead.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Sequence

import fsspec
import numpy as np
import zarr
import zarr.storage

from pipeline.store.format import is_local
from pipeline.store.hashing import DEFAULT_CHECKSUM, new_digest

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 1024
_INDEX_ENTRY_BYTES = 16  # (offset, nbytes) as two little-endian uint64 per inner chunk
_CRC_BYTES = 4


def zarr_store(fs: fsspec.AbstractFileSystem, path: str, *, read_only: bool) -> Any:
    """A zarr store over `path` on `fs` (LocalStore on disk, FsspecStore elsewhere).

    zarr needs an asynchronous filesystem: natively async ones (s3fs, gcsfs) are reopened in async
    mode from their URL; synchronous ones (memory, a local chunk cache) are wrapped as they are.
    """
    if is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    # type(fs): a caching wrapper delegates attribute reads to the filesystem it wraps, so the
    # instance may claim async_impl while its own methods are synchronous.
    if type(fs).async_impl:
        return zarr.storage.FsspecStore.from_url(fs.unstrip_protocol(path), read_only=read_only,
                                                 storage_options=getattr(fs, "storage_options", None))
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    return zarr.storage.FsspecStore(AsyncFileSystemWrapper(fs, asynchronous=True), read_only=read_only,
                                    path=path)


def chunk_rows(num_tokens: int, target: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Rows per inner chunk: near `target`, chosen so the padded last chunk wastes < one row per chunk."""
    num_chunks = max(1, math.ceil(num_tokens / target))
    return max(1, math.ceil(num_tokens / num_chunks))


def _create_hidden_array(store: Any, name: str, num_tokens: int, hidden: int, dtype: np.dtype, *,
                         logical_dtype: str, layer: int, compressors: Any, chunk_tokens: int) -> tuple[Any, int, int]:
    """The metadata of one sharded array [tokens, hidden], chunked along tokens; (array, rows per chunk,
    chunks). The single Zarr shard spans every chunk, the last padded with zeros."""
    rows = chunk_rows(num_tokens, chunk_tokens)
    num_chunks = max(1, math.ceil(num_tokens / rows))
    array = zarr.create_array(
        store=store, name=name, shape=(num_tokens, hidden), dtype=dtype,
        chunks=(rows, hidden), shards=(rows * num_chunks, hidden), compressors=compressors, fill_value=0,
        config={"write_empty_chunks": True},
        attributes={"logical_dtype": logical_dtype, "layer": layer,
                    "encoding": "uint16 bit pattern of bfloat16" if logical_dtype == "bfloat16" else "native"},
        dimension_names=("token", "hidden"))
    return array, rows, num_chunks


def _back_to_back_index(num_chunks: int, chunk_bytes: int) -> np.ndarray:
    """The shard index [chunks, 2] (offset, nbytes) of raw chunks laid back to back from the file's start."""
    return np.stack([np.arange(num_chunks, dtype="<u8") * chunk_bytes,
                     np.full(num_chunks, chunk_bytes, dtype="<u8")], axis=1)


def write_hidden_array(store: Any, name: str, values: np.ndarray, *, logical_dtype: str, layer: int,
                       compression: str | None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
    """Write `values` [tokens, hidden] as one sharded Zarr array, chunked along tokens."""
    compressors = None if compression in (None, "none") else [_compressor(compression)]
    array, _, _ = _create_hidden_array(store, name, *values.shape, values.dtype, logical_dtype=logical_dtype,
                                       layer=layer, compressors=compressors, chunk_tokens=chunk_tokens)
    array[:] = values


RawFile = tuple[str, str, list[memoryview]]  # (path relative to the shard, absolute path, buffers in order)


def plan_raw_hidden_array(store: Any, directory: str, name: str, parts: Sequence[np.ndarray], *,
                          logical_dtype: str, layer: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> RawFile:
    """`write_hidden_array` without compression on a local disk, at disk speed: the same files, byte for byte.

    `parts`: the samples' `[L_i, hidden]` rows of this layer, in order (not concatenated: no copy). zarr
    writes the metadata here; the shard file (raw inner chunks back to back, zero padding of the last chunk,
    the chunk index and its crc32c: what `map_hidden_array` maps) is returned as the buffers to write, for
    `write_raw_files`, instead of zarr's async encode and a read-back to hash (0.8 s + 0.2 s per 0.27 GB)."""
    import google_crc32c

    num_tokens = sum(int(part.shape[0]) for part in parts)
    hidden, dtype = int(parts[0].shape[1]), np.dtype(parts[0].dtype).newbyteorder("<")
    _, rows, num_chunks = _create_hidden_array(store, name, num_tokens, hidden, dtype, logical_dtype=logical_dtype,
                                               layer=layer, compressors=None, chunk_tokens=chunk_tokens)
    chunk_bytes = rows * hidden * dtype.itemsize
    index = _back_to_back_index(num_chunks, chunk_bytes).tobytes()
    tail = [bytes((rows * num_chunks - num_tokens) * hidden * dtype.itemsize), index,
            np.uint32(google_crc32c.value(index)).astype("<u4").tobytes()]
    relative = f"{name}/c/0/0"
    path = os.path.join(directory, *relative.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffers = [memoryview(np.ascontiguousarray(part, dtype=dtype)).cast("B") for part in parts]
    return relative, path, buffers + [memoryview(part) for part in tail]


def write_raw_files(files: Sequence[RawFile]) -> dict[str, tuple[str, int]]:
    """Write and hash planned files, several at once (one per core at most), so that one shard's layer
    files reach the disk side by side. Returns {relative path: (hex digest, bytes)}, the digest in the
    store's checksum algorithm (pipeline/store/hashing.py: BLAKE3 for new stores)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(files) <= 1:
        return {relative: write_hashed(path, buffers) for relative, path, buffers in files}
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1),
                            thread_name_prefix="store-write") as pool:
        results = [(relative, pool.submit(write_hashed, path, buffers)) for relative, path, buffers in files]
        return {relative: future.result() for relative, future in results}


def write_hashed(path: str, buffers: Sequence[Any], algorithm: str = DEFAULT_CHECKSUM) -> tuple[str, int]:
    """Write `buffers` to `path` in order while one other thread feeds them to the digest (both release the
    GIL on large buffers): the file is hashed on the pass that writes it, never read back. (hex digest,
    bytes). The data is synced as soon as it is written, while the hash catches up: the disk then works
    during the hash instead of after it, and the shard's commit, which fsyncs its whole directory, finds
    this file already on disk."""
    from concurrent.futures import ThreadPoolExecutor

    digest = new_digest(algorithm)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-hash") as hasher, open(path, "wb") as handle:
        for buffer in buffers:
            hasher.submit(digest.update, buffer)  # one worker: updates run in submission order
            handle.write(buffer)
        handle.flush()
        getattr(os, "fdatasync", os.fsync)(handle.fileno())  # macOS has no fdatasync
    return digest.hexdigest(), sum(memoryview(buffer).nbytes for buffer in buffers)


def write_scale_array(store: Any, name: str, scales: np.ndarray, *, layer: int) -> None:
    """Per-token float32 scales [tokens] of an fp8 layer (small: read whole by the reader)."""
    array = zarr.create_array(store=store, name=name, shape=scales.shape, dtype=np.float32,
                              chunks=(max(1, min(len(scales), 1 << 16)),), compressors=None, fill_value=0.0,
                              config={"write_empty_chunks": True}, attributes={"layer": layer},
                              dimension_names=("token",))
    array[:] = scales.astype(np.float32)


def _compressor(name: str) -> Any:
    from zarr.codecs import ZstdCodec
    if name == "zstd":
        # Level 1: on the demo target's states within 1.5% of level 3's and 9's size, and 4x faster than
        # level 3 on int8 codes (~900 against ~200 MB/s a core; bench/compression.py).
        return ZstdCodec(level=1)
    raise ValueError(f"unknown compression {name!r}; use 'none' or 'zstd'")


def map_hidden_array(array_dir: str, *, dtype: np.dtype, num_tokens: int, hidden: int) -> np.ndarray | None:
    """Memory-map the single shard file of an array written by `write_hidden_array`, zero-copy.

    Returns None when the layout is not contiguous raw chunks (compressed, or written by another
    tool), in which case the caller reads through zarr instead.
    """
    shard_file = os.path.join(array_dir, "c", "0", "0")
    rows = _raw_inner_chunk_rows(os.path.join(array_dir, "zarr.json"))
    if rows is None or not os.path.exists(shard_file):
        return None
    size = os.path.getsize(shard_file)
    num_chunks = math.ceil(num_tokens / rows)
    chunk_bytes = rows * hidden * dtype.itemsize
    index_bytes = num_chunks * _INDEX_ENTRY_BYTES + _CRC_BYTES
    if size != num_chunks * chunk_bytes + index_bytes:
        return None
    with open(shard_file, "rb") as handle:
        handle.seek(size - index_bytes)
        index = np.frombuffer(handle.read(index_bytes - _CRC_BYTES), dtype="<u8").reshape(num_chunks, 2)
    if not np.array_equal(index, _back_to_back_index(num_chunks, chunk_bytes)):
        return None
    # mode "c" (copy-on-write): writable views for torch, yet the file itself is never modified.
    return np.memmap(shard_file, dtype=dtype, mode="c", offset=0, shape=(num_tokens, hidden))


def _raw_inner_chunk_rows(metadata_path: str) -> int | None:
    """Rows per inner chunk if the array is one shard of raw little-endian chunks, index at the end."""
    try:
        with open(metadata_path, encoding="utf-8") as handle:
            codecs = json.load(handle)["codecs"]
        (sharding,) = codecs
        config = sharding["configuration"]
        (inner,) = config["codecs"]
        if sharding["name"] != "sharding_indexed" or inner["name"] != "bytes" \
                or inner.get("configuration", {}).get("endian", "little") != "little" \
                or config.get("index_location", "end") != "end" \
                or [c["name"] for c in config["index_codecs"]] != ["bytes", "crc32c"]:
            return None
        return int(config["chunk_shape"][0])
    except (OSError, KeyError, ValueError, TypeError):
        return None

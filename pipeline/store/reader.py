"""Reading a feature store: O(1) random access to samples, zero-copy hidden states on local disk.

`open_store(url)` refuses anything it cannot read correctly (no manifest, unknown major version,
missing or wrongly sized files, paths or links leaving the store) with one line naming the path and the
fix. No pickle anywhere: tables are Arrow, hidden states Zarr, weights safetensors, metadata JSON.

`open_store(url, verify="first-read")` (what the trainer uses) also checks the manifest's identity at
open and hashes each file the first time it is read, before any of its bytes are returned: a corrupted,
truncated or foreign file raises StoreIntegrityError naming it. Training reads every byte in its first
epoch anyway, so this costs one checksum pass (BLAKE3, or sha256 for older stores) over data that is being
read, not a second read of the store.
"""
from __future__ import annotations

import bisect
import json
import logging
import threading
from functools import cached_property
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store import quantized
from pipeline.store import integrity
from pipeline.store.errors import StoreError, StoreFormatError, StoreNotFoundError
from pipeline.store.hashing import has_valid_checksum
from pipeline.store.zarr_io import map_hidden_array, zarr_store

log = logging.getLogger(__name__)

SUPPORTED_MAJOR = 1
# The sample table's columns and their Arrow types (pipeline.store.writer.SAMPLES_SCHEMA).
_TABLE_COLUMNS = {"sample_id": pa.string(), "length": pa.int32(), "token_offset": pa.int64(),
                  "input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.uint8())}


class _Shard:
    """One shard's sample table and per-layer hidden-state arrays, opened lazily."""

    def __init__(self, store: "FeatureStore", info: dict):
        self._store = store
        self.info = info
        self.directory = fmt.join(store.root, fmt.SHARDS_DIR, info["name"])
        self._verified: set[str] = set()
        self._verify_lock = threading.Lock()

    def _verify(self, *, table: bool) -> None:
        """verify="first-read": hash the files about to be read (the sample table, or everything else:
        Zarr metadata and hidden-state arrays) once, before any of their bytes are used."""
        if self._store.verify != integrity.VERIFY_FIRST_READ or not self._store.verifies(self.info["index"]):
            return
        sample_file = f"{fmt.SHARDS_DIR}/{self.info['name']}/{fmt.SAMPLES_FILE}"
        wanted = [rel for rel in sorted(self.info["files"]) if (rel == sample_file) == table]
        with self._verify_lock:
            for relative in wanted:
                if relative not in self._verified:
                    problem, _ = integrity.file_problem(self._store.fs, self._store.root, relative,
                                                        self.info["files"][relative])
                    integrity.raise_first([problem], self._store.url)
                    self._verified.add(relative)

    def _check_kinds(self, *, table: bool) -> None:
        """The files about to be read are regular files inside the store (stat only): a FIFO would block
        the read forever and a device never end it. Done whatever `verify` says."""
        sample_file = f"{fmt.SHARDS_DIR}/{self.info['name']}/{fmt.SAMPLES_FILE}"
        for relative in sorted(self.info["files"]):
            if (relative == sample_file) == table:
                problem = files.kind_problem(self._store.fs, self._store.root, relative)
                if problem:
                    raise StoreFormatError(f"{self._store.url}: {problem}; do not use this store")

    @property
    def table_file(self) -> str:
        """The sample table's path relative to the store root."""
        return f"{fmt.SHARDS_DIR}/{self.info['name']}/{fmt.SAMPLES_FILE}"

    def read_table(self) -> dict[str, np.ndarray]:
        """The sample table as arrays, its Arrow structure and column types checked, its content not
        (`table` checks that; `verify` lists every problem of it instead)."""
        self._check_kinds(table=True)
        self._verify(table=True)
        fs = self._store.fs
        path = fmt.join(self.directory, fmt.SAMPLES_FILE)
        relative = self.table_file
        try:
            source = pa.memory_map(path) if fmt.is_local(fs) else pa.BufferReader(
                files.read_bounded(fs, self._store.root, relative, self.info["files"][relative]["bytes"]))
            table = pa.ipc.open_stream(source).read_all().combine_chunks()
            table.validate(full=True)  # list offsets inside their values, and the like
            for name, kind in _TABLE_COLUMNS.items():
                if table.schema.field(name).type != kind:
                    raise TypeError(f"column {name} is {table.schema.field(name).type}, not {kind}")
        except (pa.ArrowException, KeyError, TypeError) as error:
            raise StoreFormatError(f"{self._store.url}: {relative}: not a sample table of this format "
                                   f"({type(error).__name__}: {error}); run `beagle-pipeline verify`") from None
        if table.num_rows != self.info["samples"]:
            raise StoreFormatError(f"{path}: {table.num_rows} samples, manifest says {self.info['samples']}; "
                                   "run `beagle-pipeline verify`")
        # combine_chunks, not chunk(0): the table of an empty shard (every sample dropped) has no chunk
        input_ids, loss_mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        return {
            "sample_id": table.column("sample_id").to_pylist(),
            "length": table.column("length").to_numpy(),
            "token_offset": table.column("token_offset").to_numpy(),
            "list_offsets": input_ids.offsets.to_numpy(),
            "input_ids": input_ids.values.to_numpy(),
            "loss_mask": loss_mask.values.to_numpy(),
            "mask_offsets": loss_mask.offsets.to_numpy(),
        }

    def table_problems(self, table: dict[str, np.ndarray]) -> list[str]:
        return integrity.table_problems(table, self.info, vocab_size=self._store.vocab_size, where=self.table_file)

    @cached_property
    def table(self) -> dict[str, np.ndarray]:
        """The sample table, refused (StoreFormatError) unless every sample lies where the states are."""
        table = self.read_table()
        problems = self.table_problems(table)
        if problems:
            raise StoreFormatError(f"{self._store.url}: {problems[0]}; the store is damaged or hostile, do not "
                                   f"train on it (`beagle-pipeline verify {self._store.url}` lists every problem)")
        return table

    @cached_property
    def hidden(self) -> list[Any]:
        """Per layer: a read-only memmap [tokens, d] on local disk, else a zarr array read by chunks."""
        store = self._store
        self._check_kinds(table=False)
        self._verify(table=False)
        arrays = []
        for layer in store.layers:
            array_path = fmt.join(self.directory, fmt.hidden_array_name(layer))
            mapped = None
            if fmt.is_local(store.fs):
                mapped = map_hidden_array(array_path, dtype=fmt.storage_dtype(store.dtype),
                                          num_tokens=self.info["tokens"], hidden=store.hidden_size)
            if mapped is None:
                import zarr
                mapped = zarr.open_array(zarr_store(store.fs, self.directory, read_only=True),
                                         path=fmt.hidden_array_name(layer), mode="r")
            if tuple(mapped.shape) != (self.info["tokens"], store.hidden_size):
                raise StoreFormatError(f"{store.url}: {fmt.SHARDS_DIR}/{self.info['name']}/"
                                       f"{fmt.hidden_array_name(layer)}: shape {tuple(mapped.shape)}, the manifest "
                                       f"says ({self.info['tokens']}, {store.hidden_size}); run `beagle-pipeline verify`")
            arrays.append(mapped)
        return arrays

    @cached_property
    def scales(self) -> list[np.ndarray]:
        """Lossy (fp8, int8) stores only: per layer, the per-token scales [tokens] float32 (read whole,
        4 bytes/token)."""
        import zarr

        self._check_kinds(table=False)
        self._verify(table=False)
        zstore = zarr_store(self._store.fs, self.directory, read_only=True)
        scales = []
        for layer in self._store.layers:
            array = zarr.open_array(zstore, path=fmt.scale_array_name(layer), mode="r")
            if tuple(array.shape) != (self.info["tokens"],):  # read whole below: its size must be the shard's
                raise StoreFormatError(f"{self._store.url}: {fmt.SHARDS_DIR}/{self.info['name']}/"
                                       f"{fmt.scale_array_name(layer)}: shape {tuple(array.shape)}, the manifest "
                                       f"says ({self.info['tokens']},); run `beagle-pipeline verify`")
            scales.append(np.asarray(array[:]))
        return scales

    def tokens_numpy(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """input_ids [L] and loss_mask [L] of one row, from the sample table alone (no state is read)."""
        table = self.table
        start, end = table["list_offsets"][row], table["list_offsets"][row + 1]
        mask_start = table["mask_offsets"][row]
        return table["input_ids"][start:end], table["loss_mask"][mask_start:mask_start + (end - start)]

    def sample_numpy(self, row: int, *, decode: bool = True) -> dict[str, Any]:
        table = self.table
        input_ids, loss_mask = self.tokens_numpy(row)
        first = int(table["token_offset"][row])
        length = int(table["length"][row])
        # [L, d] views (memmap) or reads, typed as what they hold (ml_dtypes.bfloat16, float8_e4m3fn, ...)
        hidden = [fmt.typed_view(array[first:first + length], self._store.dtype) for array in self.hidden]
        sample = {"sample_id": table["sample_id"][row], "input_ids": input_ids, "loss_mask": loss_mask}
        if self._store.dtype in fmt.LOSSY_DTYPES:
            scales = [layer_scales[first:first + length] for layer_scales in self.scales]  # [L] each
            if not decode:
                return {**sample, "hidden_states": hidden, "hidden_scales": scales}
            hidden = [quantized.decode(self._store.dtype, codes, token_scales)
                      for codes, token_scales in zip(hidden, scales)]
        return {**sample, "hidden_states": hidden}


class FeatureStore:
    """A complete, read-only feature store. `store[i]` gives one sample as numpy arrays.

    The store never imports torch; `beagle.torch_store` gives the same samples and head as torch tensors.
    """

    def __init__(self, url: str, *, check_files: bool = True, cache_dir: str | None = None,
                 verify: str = integrity.VERIFY_NONE, verify_share: tuple[int, int] = (0, 1)):
        if verify not in integrity.VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: use one of {list(integrity.VERIFY_MODES)}")
        self.url = str(url)
        self.verify = verify
        self.verify_share = verify_share
        self.fs, self.root = fmt.open_fs(self.url)
        if cache_dir is not None and not fmt.is_local(self.fs):
            # Remote store: each file is fetched whole on first touch and kept in cache_dir, so epochs
            # after the first (and later runs on this machine) read local disk. Files never touched
            # are never fetched. The store's checksums make stale cache entries detectable by verify.
            self.fs = fsspec.filesystem("filecache", fs=self.fs, cache_storage=str(cache_dir),
                                        check_files=False, same_names=False)
        self.manifest = _load_manifest(self.fs, self.root, self.url)
        _check_paths(self.manifest, self.url)
        if check_files or verify != integrity.VERIFY_NONE:
            _check_files_present(self.fs, self.root, self.manifest, self.url)
        if verify != integrity.VERIFY_NONE:
            # Cheap checks first: a hand-edited manifest, counts that do not add up, small top-level files.
            integrity.raise_first([integrity.identity_problem(self.manifest),
                                   *integrity.count_problems(self.manifest)], self.url)
            integrity.raise_first([integrity.file_problem(self.fs, self.root, relative, meta)[0]
                                   for relative, meta in sorted(self.manifest["files"].items())
                                   if relative != fmt.HEAD], self.url)  # the head is checked as it is read
        self._shards = [_Shard(self, info) for info in self.manifest["shards"]]
        self._starts = np.cumsum([0] + [info["samples"] for info in self.manifest["shards"]]).tolist()

    # Facts from the manifest -------------------------------------------------------------------
    @property
    def dataset_id(self) -> str:
        return self.manifest["dataset_id"]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def layers(self) -> list[int]:
        return list(self.manifest["layers"])

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["counts"]["tokens"])

    @property
    def vocab_size(self) -> int | None:
        """The target's vocabulary size as the manifest records it (token ids must lie below), if it does."""
        vocab = (self.target.get("architecture") or {}).get("vocab_size")
        return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per sample, [num_samples] int64: for token-budget batching without touching states.
        Reads (and checks) every sample table; sample ids must be unique across the shards."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        problem = integrity.duplicate_id_problem([(f"{fmt.SHARDS_DIR}/{shard.info['name']}", shard.table["sample_id"])
                                                  for shard in self._shards])
        if problem:
            raise StoreFormatError(f"{self.url}: {problem}; the store is damaged or hostile, do not train on it")
        return np.concatenate([shard.table["length"] for shard in self._shards]).astype(np.int64)

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return (f"FeatureStore({self.url!r}, samples={len(self)}, tokens={self.num_tokens}, "
                f"hidden_size={self.hidden_size}, layers={self.layers}, dtype={self.dtype})")

    # Access ---------------------------------------------------------------------------------------
    def _locate(self, index: int) -> tuple[_Shard, int]:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"store indices must be integers, not {type(index).__name__}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a store of {len(self)} samples")
        shard = bisect.bisect_right(self._starts, index) - 1
        return self._shards[shard], index - self._starts[shard]

    def get_numpy(self, index: int, *, decode: bool = True) -> dict[str, Any]:
        """One sample with hidden states as a list (one per layer) of [L, d] arrays typed as the store's dtype
        (ml_dtypes.bfloat16 for bfloat16, a zero-copy view of the stored bits; float32 decoded values for
        float8_e4m3). decode=False keeps float8_e4m3 states as their codes (ml_dtypes.float8_e4m3fn, the
        stored bytes), with `hidden_scales` (one [L] float32 array per layer): value = code * scale."""
        shard, row = self._locate(index)
        return shard.sample_numpy(row, decode=decode)

    def get_tokens(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """input_ids [L] and loss_mask [L] of one sample without touching its hidden states (token counts)."""
        shard, row = self._locate(index)
        return shard.tokens_numpy(row)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """`sample_id`, `input_ids` [L] int64, `loss_mask` [L] bool, `hidden_states` [n_layers, L, d] in the
        store's dtype (ml_dtypes.bfloat16 for bfloat16, zero-copy; float32 for float8_e4m3, decoded)."""
        sample = self.get_numpy(index)
        layers = [np.asarray(array) for array in sample["hidden_states"]]  # zero-copy for a memmap slice
        # One layer: a zero-copy view of the memory map; several layers are stacked (one copy).
        hidden = layers[0][None] if len(layers) == 1 else np.stack(layers)
        return {
            "sample_id": sample["sample_id"],
            "input_ids": sample["input_ids"].astype(np.int64),
            "loss_mask": sample["loss_mask"].astype(np.bool_),
            "hidden_states": hidden,
        }

    def verifies(self, shard_index: int) -> bool:
        """Whether this reader hashes shard `shard_index` on first read: all of them alone, or its share
        (index mod world == rank) when `verify_share=(rank, world)` splits the work between the ranks of
        one data-parallel job, so that the job hashes each shard once, not once per rank."""
        rank, world = self.verify_share
        return shard_index % world == rank

    def head_bytes(self) -> bytes:
        """The bytes of `head.safetensors` (the frozen `embed_tokens` and `lm_head`, each [V, d]), checked
        against the manifest's checksum when the store was opened with verify; parse with safetensors."""
        payload = files.read_bounded(self.fs, self.root, fmt.HEAD, self.manifest["files"][fmt.HEAD]["bytes"])
        if self.verify != integrity.VERIFY_NONE:
            integrity.raise_first([integrity.bytes_problem(fmt.HEAD, payload, self.manifest["files"][fmt.HEAD])],
                                  self.url)
        return payload


def open_store(url: str, *, check_files: bool = True, cache_dir: str | None = None,
               verify: str = integrity.VERIFY_NONE, verify_share: tuple[int, int] = (0, 1)) -> FeatureStore:
    """Open a complete store at a local path or fsspec URL. Raises StoreError with the fix on failure.

    cache_dir: for a remote store, a local folder that caches the blocks read (ignored for local stores).
    verify: "none" (listed files present with the right size, if check_files), or "first-read": also the
    manifest's identity at open, and each file's checksum the first time it is read (StoreIntegrityError).
    verify_share: (rank, world) of a data-parallel job: hash only the shards with index mod world == rank.
    """
    return FeatureStore(url, check_files=check_files, cache_dir=cache_dir, verify=verify, verify_share=verify_share)


def load_manifest(fs: Any, root: str, url: str) -> dict:
    """The manifest of the store at `root` on `fs`, read within bounds and checked for shape and paths
    (StoreError naming `url` otherwise); no other file of the store is touched."""
    return _load_manifest(fs, root, url)


def _load_manifest(fs: Any, root: str, url: str) -> dict:
    path = fmt.join(root, fmt.MANIFEST)
    try:
        payload = files.read_bounded(fs, root, fmt.MANIFEST, files.MANIFEST_MAX_BYTES)
        manifest = json.loads(payload)  # JSON only: a hostile manifest can describe, not execute
    except FileNotFoundError:
        if fs.exists(fmt.join(root, fmt.PENDING)):
            raise StoreNotFoundError(f"{url} is an unfinished store (no {fmt.MANIFEST}): "
                                     f"{unfinished_fix(fs, root)}") from None
        raise StoreNotFoundError(f"{url} is not a feature store: {fmt.MANIFEST} not found; "
                                 "check the path or build one with `beagle-pipeline extract`") from None
    except StoreFormatError as error:  # a link out of the store, a FIFO, a device, or far too large
        raise StoreFormatError(f"{url}: {error}; do not use this store") from None
    except (ValueError, RecursionError) as error:  # RecursionError: absurdly deep nesting
        raise StoreFormatError(f"{path} is not valid JSON ({type(error).__name__}); "
                               "the store is damaged, rebuild it") from None
    return check_manifest(manifest, url)


def unfinished_fix(fs: Any, root: str) -> str:
    """How to complete an unfinished store: rerun the command that started it, as its pending marker says."""
    try:
        pending = json.loads(files.read_bounded(fs, root, fmt.PENDING, files.SMALL_JSON_MAX_BYTES))
    except (OSError, ValueError, RecursionError):  # StoreFormatError is a ValueError
        pending = None
    command = pending.get("command", "extract") if isinstance(pending, dict) else "extract"
    if command == "merge":
        return "rerun the same `beagle-pipeline merge` command to complete it"
    if command == "extract":
        return "rerun the same extract command to complete it"
    return "write it again the same way to complete it"


def check_manifest(manifest: Any, url: str) -> dict:
    """The manifest as it was parsed, if it is one this version reads: a schema version it knows, every
    field the reader relies on, of the right type; else StoreFormatError saying what is wrong. (Paths
    leaving the store are refused separately, by `_check_paths`.)"""
    path = fmt.join(url, fmt.MANIFEST)
    if not isinstance(manifest, dict) or "schema_version" not in manifest:
        raise StoreFormatError(f"{path} has no schema_version; it is not a beagle-pipeline store")
    major = fmt.major_version(manifest["schema_version"])
    if major != SUPPORTED_MAJOR:
        raise StoreFormatError(f"{url} has schema_version {manifest['schema_version']}, this beagle-pipeline "
                               f"reads {SUPPORTED_MAJOR}.x; install a matching beagle-pipeline version")
    for key in ("dataset_id", "hidden_size", "layers", "dtype", "shards", "counts", "target", "files"):
        if key not in manifest:
            raise StoreFormatError(f"{path} lacks {key!r}; the store is damaged, rebuild it")
    _check_types(manifest, path)
    fmt.storage_dtype(manifest["dtype"])
    return manifest


def _check_types(manifest: dict, path: str) -> None:
    """The structure the reader relies on, so that a damaged or hostile manifest fails here with one line
    rather than as a TypeError deep inside a read."""
    def entries_ok(files: Any) -> bool:
        return isinstance(files, dict) and all(
            has_valid_checksum(meta) and _is_int(meta.get("bytes"))
            for meta in files.values())

    ok = (isinstance(manifest["shards"], list) and isinstance(manifest["counts"], dict)
          and isinstance(manifest["target"], dict) and entries_ok(manifest["files"])
          and isinstance(manifest["layers"], list) and all(_is_int(x) for x in manifest["layers"])
          and _is_int(manifest["hidden_size"]) and isinstance(manifest["dataset_id"], str)
          and all(isinstance(s, dict) and isinstance(s.get("name"), str) and entries_ok(s.get("files"))
                  and all(_is_int(s.get(k)) for k in ("index", "samples", "tokens", "loss_tokens"))
                  for s in manifest["shards"]))
    if not ok:
        raise StoreFormatError(f"{path}: fields of the wrong type (shards, files, counts or layers); "
                               "the manifest is damaged or hostile, do not use this store")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_paths(manifest: dict, url: str) -> None:
    for relative in integrity.listed_files(manifest):
        fmt.safe_relpath(relative, where=f"{url}/{fmt.MANIFEST}")
    for shard in manifest["shards"]:
        name = shard.get("name", "")
        if fmt.safe_relpath(name, where=f"{url}/{fmt.MANIFEST}") != fmt.shard_name(int(shard["index"])):
            raise StoreFormatError(f"{url}/{fmt.MANIFEST}: shard name {name!r} does not match its index")


def _check_files_present(fs: Any, root: str, manifest: dict, url: str) -> None:
    """Every listed file is present with its recorded size (one listing, no reads); on local disk none
    is a link leading out of the store."""
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    sizes = {path[len(root) + 1:]: info.get("size") for path, info in found.items()}
    for relative, meta in integrity.listed_files(manifest).items():
        if relative not in sizes:
            raise StoreNotFoundError(f"{url}: {relative} is missing; the store is incomplete or damaged "
                                     "(run `beagle-pipeline verify`, then rebuild the missing shard)")
        link = integrity.link_problem(fs, root, relative)  # a link out of the store, a FIFO, a device
        if link:
            raise StoreFormatError(f"{url}: {link}; do not use this store")
        if sizes[relative] is not None:
            integrity.raise_first([integrity.size_problem(relative, int(sizes[relative]), meta)], url)


__all__ = ["FeatureStore", "StoreError", "open_store"]

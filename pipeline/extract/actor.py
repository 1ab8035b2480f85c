"""The Ray stages' code: tokenize tasks and the forward actor that turns a whole shard into stored states.

Both are plain Python (a function, a class), so they run and are tested without Ray; the driver
(pipeline.extract.dispatch and pipeline.extract.stream) makes them Ray tasks and actors. The actor writes
its shard itself: shipping [n, L, d] states back through the object store to a separate writer would copy
the largest thing in the job for nothing.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from beagle.errors import BeagleError
from beagle.records import RejectReason, RejectRecord
from pipeline.extract.chat import tokenize_record
from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.forward import ForwardConfig, TargetForward
from pipeline.store.format import StoreEncoding
from pipeline.extract.inputs import Record

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str, trust_remote_code: bool) -> Any:
    return load_tokenizer(model_path, trust_remote_code=trust_remote_code)


def tokenize_records(tokenizer: Any, records: list[Record], *, max_length: int) -> list[tuple[str, dict]]:
    """("sample", {sample_id, input_ids, loss_mask, truncated, where}) or ("reject", {source, index, reason...}).

    A sample keeps `where` its record is ({source, index, line}), for a reject found after tokenizing
    (non-finite states, on the forward actor)."""
    out: list[tuple[str, dict]] = []
    for record in records:
        where = {"source": record.source, "index": record.index}
        if record.line is not None:
            where["line"] = record.line
        try:
            tokenized = tokenize_record(tokenizer, record, max_length=max_length)
        except Exception as error:  # noqa: BLE001 - one odd record must not fail a whole tokenize task
            reject = error if isinstance(error, RejectRecord) else RejectRecord(
                RejectReason.TOKENIZER_ERROR, f"{type(error).__name__}: {str(error)[:200]}")
            out.append(("reject", reject.as_dict(**where, sample_id=record.sample_id)))
            continue
        out.append(("sample", {"sample_id": record.sample_id, "input_ids": tokenized.input_ids,
                               "loss_mask": tokenized.loss_mask, "truncated": tokenized.truncated,
                               "dropped_leading_assistant": record.dropped_leading_assistant, "where": where}))
    return out


def non_finite_reject(sample: dict[str, Any], layers: list[int], dtype: str) -> dict[str, Any]:
    """The rejects file's row for a sample whose states hold an inf or NaN: where its record is, as for
    every reject, so that the user finds the record."""
    return RejectRecord(RejectReason.NON_FINITE_STATES,
                        f"inf or NaN in the target's hidden states (captured layers {list(layers)}): the target "
                        f"overflows in {dtype}; extract in bfloat16 or float32").as_dict(
        **sample.get("where", {}), sample_id=sample["sample_id"])


def tokenize_chunk(records: list[Record], *, model_path: str, trust_remote_code: bool,
                   max_length: int) -> list[tuple[str, dict]]:
    """Ray task: `tokenize_records` of one chunk, with this worker's tokenizer (loaded once per process)."""
    return tokenize_records(_tokenizer(model_path, trust_remote_code), records, max_length=max_length)


class ShardExtractor:
    """Forward actor: loads the target once; per call, forwards one shard's samples and commits the shard.

    Two calls run at once on two threads of the actor (the driver keeps two shards in flight per actor, the
    actor runs with max_concurrency=2): the forward is serialised by a lock, so while one shard is encoded,
    hashed and written the next shard's forward already runs, and the device never waits for the disk. At
    most one shard waits for its write behind the one being forwarded: the back-pressure when the writer
    falls behind. A write that fails (a full disk) returns its error as data; its shard is never committed,
    and the driver stops the job. A sample whose states are not finite is left out of its shard and recorded
    in the shard's shard.json as a reject (`non_finite_reject`); the shard is committed even when that leaves
    it empty, so shard numbering never depends on the forward.

    Also writes the store's head (embedding + LM head) once if it is not there yet: every actor holds
    the model already, and the head write is atomic, so two actors (or threads) racing write the same bytes.
    """

    def __init__(self, config: ForwardConfig, store_url: str, encoding: StoreEncoding | None = None) -> None:
        self.config = config
        self.store_url = store_url
        self.encoding = encoding or StoreEncoding(config.dtype)  # the stored dtype and codec
        # An engine that cannot start (vLLM refusing the model) is raised by the first shard's call: Ray hands
        # a method's exception back as itself, for the one-line report, but a constructor's only as text.
        self.failed: BeagleError | None = None
        self.forward: Any = None
        try:
            self.forward = open_forward(config)
        except BeagleError as error:
            self.failed = error
        self._forward_lock = threading.Lock()
        self._head_done = False

    def close(self) -> None:
        """End the engine (a vLLM worker process and its scratch folder); the dispatcher calls it before it
        stops the actor."""
        with self._forward_lock:
            if self.forward is not None and hasattr(self.forward, "close"):
                self.forward.close()
            self.forward = None

    def _ensure_head(self) -> None:
        from pipeline.store import format as fmt
        from pipeline.extract.state_encoding import write_head

        fs, root = fmt.open_fs(self.store_url)
        if not fs.exists(fmt.join(root, fmt.HEAD)):
            write_head(self.store_url, **self.forward.head())
        self._head_done = True

    def extract(self, shard_index: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Forward and commit shard `shard_index` ({sample_id, input_ids [L], loss_mask [L], where} per sample).

        Returns {"shard_index", "info": the committed shard's info (its `rejects`: the samples left out for
        non-finite states), or {"os_error": {errno, strerror, filename}}, "seconds": forward + write,
        "forward_seconds", "spans": [forward start, forward end, committed] (time.time()), "pid", "node"}."""
        from pipeline.extract.state_encoding import write_shard

        if self.failed is not None:
            raise self.failed
        with self._forward_lock:  # one forward at a time on the device; the other thread writes meanwhile
            forward_started = time.time()
            states = self.forward.hidden_states([s["input_ids"] for s in samples])  # each [n_layers, L, d]
            forward_ended = time.time()
        rows = [{"sample_id": s["sample_id"], "input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                 "hidden_states": h} for s, h in zip(samples, states) if h is not None]
        rejects = [non_finite_reject(s, self.forward.layers, self.config.dtype)
                   for s, h in zip(samples, states) if h is None]
        if rejects:
            logger.warning("shard %d: %d of %d samples have non-finite states (first: %s); rejected",
                           shard_index, len(rejects), len(samples), rejects[0]["sample_id"])
        try:
            info: dict[str, Any] = write_shard(self.store_url, int(shard_index), rows, layers=self.forward.layers,
                                               dtype=self.encoding.dtype, compression=self.encoding.codec,
                                               hidden_size=self.forward.hidden_size, rejects=rejects)
            if not self._head_done:
                self._ensure_head()
        except OSError as error:
            # A full disk (or a lost mount, a permission) is the user's to fix: hand it to the driver as
            # data, which raises it as the OSError it is, instead of Ray's traceback of a failed task.
            info = {"os_error": {"errno": error.errno, "strerror": error.strerror,
                                 "filename": str(error.filename or self.store_url)}}
        committed = time.time()
        if "os_error" not in info:
            logger.info("shard %d: %d samples in %.2fs (pid %d, node %s)", shard_index, len(samples),
                        committed - forward_started, os.getpid(), _node_id())
        return {"shard_index": int(shard_index), "info": info, "seconds": committed - forward_started,
                "forward_seconds": forward_ended - forward_started,  # waiting for the lock is not forward time
                "spans": [forward_started, forward_ended, committed], "pid": os.getpid(), "node": _node_id()}


def open_forward(config: ForwardConfig) -> Any:
    """The engine that runs the target in this actor: transformers (`TargetForward`) or a vLLM worker
    (`VllmForward`); both give per-sample states [n_layers, L, d] and the head."""
    if config.engine == "vllm":
        from pipeline.extract.vllm_forward import VllmForward

        return VllmForward(config)
    return TargetForward(config)


def _node_id() -> str:
    """The Ray node this actor runs on ("" outside Ray): which machine of a cluster wrote a shard."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - diagnostics only
        return ""


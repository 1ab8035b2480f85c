"""The streaming driver: shards are a function of the inputs only, and the driver's memory stays bounded
as the inputs grow (issue 16, item 3)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.inputs import scan_inputs, stream_inputs
from tests.read_all import read_inputs
from pipeline.extract.stream import ChunkSize, SampleCounts, form_shards, tokenized
from tests.tiny import build_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"), template="chatml")


def _chats(path: Path) -> Path:
    lines = [json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + "why? " * (i % 7)},
        {"from": "gpt", "value": f"Answer {i}." + " Indeed." * (i % 5)}]}) for i in range(23)]
    lines[4] = "not json"
    lines[9] = json.dumps({"id": "c3", "text": "a duplicate id"})
    lines[15] = json.dumps({"conversations": [{"from": "human", "value": "long " * 90}, {"from": "gpt", "value": "x"}]})
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_stream_reads_what_the_whole_read_reads_and_the_scan_counts_it(tmp_path):
    path = str(_chats(tmp_path / "chats.jsonl"))
    for limit in (None, 12):
        whole = read_inputs([path], limit=limit)
        scan = scan_inputs([path], limit=limit)
        stream = stream_inputs([path], scan, limit=limit)
        assert list(stream) == whole.records
        assert stream.rejects == whole.rejects and stream.sources == whole.sources == scan.sources
        assert scan.records == len(whole.records) and scan.conversations


def test_shards_depend_on_the_inputs_only_never_on_how_records_are_chunked(tmp_path, target):
    """Chunks of one record, of three, or cut by text size: the same samples in the same shards, the same
    rejects, the same counts."""
    path = str(_chats(tmp_path / "chats.jsonl"))
    tokenizer = load_tokenizer(str(target))
    runs = []
    for size in (ChunkSize(1), ChunkSize(3), ChunkSize(512, max_chars=40)):
        counts = SampleCounts()
        results = tokenized(stream_inputs([path], scan_inputs([path])), tokenizer=tokenizer, model_path=str(target),
                            trust_remote_code=False, max_length=64, chunk_size=size, in_flight=None)
        shards = [(index, [(s["sample_id"], s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in samples])
                  for index, samples in form_shards(results, 4, counts)]
        runs.append((shards, counts))
    shards, counts = runs[0]
    assert [index for index, _ in shards] == list(range(5)) and [len(s) for _, s in shards] == [4, 4, 4, 4, 4]
    assert [r["reason"] for r in counts.rejects] == ["no_loss_tokens"]
    assert counts.samples == 20 and counts.tokens == sum(len(ids) for _, s in shards for _, ids, _ in s)
    assert counts.loss_tokens == sum(int(np.sum(mask)) for _, s in shards for _, _, mask in s)
    assert all(run == runs[0] for run in runs[1:])


def _texts(path: Path, records: int) -> Path:
    """Base-model records of 64 KB of text each: with --max-length 32 the store stays small (32 tokens a
    record) while the texts add up to 6.5 MB for 100 records and 65 MB for 1000."""
    sentence = "The capital of France is Paris. "
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(records):
            handle.write(json.dumps({"id": f"t{index}", "text": f"Record {index}. " + sentence * 2048}) + "\n")
    return path


def _extract(target: Path, data: Path, out: Path) -> tuple[int, float]:
    """(samples, the driver's peak RSS in MiB) of a real `beagle-pipeline extract` run."""
    command = [str(Path(sys.executable).with_name("beagle-pipeline")), "extract", "--model", str(target),
               "--data", str(data), "--out", str(out), "--dtype", "float32", "--max-length", "32", "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = re.search(r"samples\s+([\d,]+)", done.stdout)
    peak = re.search(r"driver\s+([\d,]+) MiB peak resident memory", done.stdout)
    assert samples and peak, done.stdout
    return int(samples.group(1).replace(",", "")), float(peak.group(1).replace(",", ""))


@pytest.mark.slow
def test_the_drivers_peak_memory_does_not_grow_with_the_inputs(tmp_path, target):
    """N and 10·N long records: the driver's peak RSS grows by less than 1.3x (548 -> 587 MiB when it was
    written). The driver that read every record into memory, pickled the chunks for Ray Data and kept every
    tokenized sample grew with the inputs, about 3.5 bytes per byte of text: 563 -> 792 MiB, 1.41x."""
    small, large = _texts(tmp_path / "small.jsonl", 100), _texts(tmp_path / "large.jsonl", 1000)
    samples, small_peak = _extract(target, small, tmp_path / "small")
    assert samples == 100
    samples, large_peak = _extract(target, large, tmp_path / "large")
    assert samples == 1000
    assert large_peak < 1.3 * small_peak, (small_peak, large_peak)

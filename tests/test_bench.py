"""The bench scripts' pieces that do not time anything: records, the docs rewrite, offline acceptance, and the
GPU check's dry run."""
import pytest
import torch

from bench.acceptance import chain_acceptance
from beagle.eagle2 import eagle2_chain_tokens
from bench.common import record
from bench.run_all import BEGIN, END, render, write_docs
from beagle.data import StoreSet, collate
from beagle.eagle2 import Eagle2Drafter, Eagle2KeyCache
from beagle.model import BeagleDrafter, DrafterConfig
from tests.tiny_store import build_tiny_store


def test_record_marks_missed_targets_with_their_reason():
    assert record("P1", "x", 0.97, 0.95, ">=", "", {}, why="slow")["met"]
    missed = record("P4", "x", 1.4, 1.15, "<=", "", {}, why="rows grow")
    assert not missed["met"] and missed["why"] == "rows grow"


def test_docs_rewrite_keeps_everything_outside_the_markers(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text(f"# B\nkept above\n{BEGIN}\nold table\n{END}\nkept below\n")
    block = render([record("P3", "read", 0.8, 0.5, ">=", "0.8 GB/s", {"tokens": 5})], ["cmd"], True, 60.0)
    write_docs(doc, block)
    text = doc.read_text()
    assert "kept above" in text and "kept below" in text and "old table" not in text
    assert "| P3 read | 0.800 | >= 0.5 | yes |" in text and text.count(BEGIN) == 1
    write_docs(doc, block)
    assert doc.read_text() == text


def _random_drafter(cls, url: str, std: float):
    """(store, its head, a `cls` drafter for its target with every parameter drawn from N(0, std), seed 0)."""
    data = StoreSet([url])
    head = data.load_head()
    torch.manual_seed(0)
    model = cls(DrafterConfig.from_architecture(data.target["architecture"]), head["embed_tokens"],
                head["lm_head"]).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return data, head, model


def test_offline_eagle2_chain_matches_the_decode_time_cache(tmp_path):
    url = build_tiny_store(tmp_path / "s", num_samples=2, min_len=14, max_len=14)
    data, head, model = _random_drafter(Eagle2Drafter, url, std=0.1)
    batch = collate([data.sample(0, 100)])
    depth, n = 3, 5
    with torch.no_grad():
        offline = eagle2_chain_tokens(model, batch, depth)[(n + 1) % depth][0]
        cache = Eagle2KeyCache(model)
        ids, states = batch.input_ids[0], batch.hidden[0]
        cache.append(states[:n + 1], torch.arange(n + 1), ids[:n + 1])
        keys, values, parent = cache.keys, cache.values, cache.last_state[None, None]
        for j in range(1, depth + 1):
            p = n + j
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            hidden, k, v = model.draft_step(ids[None, p:p + 1], torch.tensor([[p]]), parent, keys, values, mask)
            assert int(model.logits(hidden).argmax()) == int(offline[p])
            keys, values, parent = torch.cat([keys, k], -2), torch.cat([values, v], -2), hidden
    beagle = BeagleDrafter(DrafterConfig.from_architecture(data.target["architecture"]), head["embed_tokens"],
                           head["lm_head"]).eval()
    tau, alphas = chain_acceptance(beagle, url, depth=3, samples=2)
    assert 1.0 <= tau <= 4.0 and len(alphas) == 3
    vocab_size = data.target["architecture"]["vocab_size"]
    assert chain_acceptance(beagle, url, depth=3, samples=2, vocab=torch.arange(vocab_size)) == (tau, alphas)
    # a drafter confined to one token the target never predicts accepts nothing
    greedy = set((data.sample(0, 512)[2].float() @ head["lm_head"].float().T).argmax(-1).tolist())
    unused = next(t for t in range(vocab_size) if t not in greedy)
    assert chain_acceptance(beagle, url, depth=3, samples=1, vocab=torch.tensor([unused]))[0] == 1.0


def test_depth1_rule_agrees_with_the_chain_and_the_bigram_table_counts_pairs(tmp_path):
    """bench/depth1.py's pieces: α1 by the depth-1 rule equals a chain of depth 1's α1 for the same drafter,
    keys ablated to the true states change nothing, and the bigram table holds each token's most frequent
    successor in the store."""
    from collections import Counter

    from bench.acceptance import beagle_depth1_predictor, bigram_predictor, depth1_acceptance

    # 8 tokens: pairs repeat (a random walk of steps 1-3) and the target's greedy token is often the data's
    url = build_tiny_store(tmp_path / "s", num_samples=12, min_len=10, max_len=16, vocab_size=8)
    data, head, beagle = _random_drafter(BeagleDrafter, url, std=0.2)
    _, alphas = chain_acceptance(beagle, url, depth=1, samples=12)
    assert depth1_acceptance(beagle_depth1_predictor(beagle), url) == pytest.approx(alphas[0])
    same_keys = beagle_depth1_predictor(beagle, keys=lambda i, batch: batch.hidden)
    assert depth1_acceptance(same_keys, url) == pytest.approx(alphas[0])
    # an oracle that guesses the target's greedy token everywhere accepts exactly where greedy is the data
    oracle = lambda i, batch: (batch.hidden[0] @ head["lm_head"].float().T).argmax(-1)  # noqa: E731
    on_data = [(s[2] @ head["lm_head"].float().T).argmax(-1)[1:-1] == s[0][2:]
               for s in (data.sample(i, 512) for i in range(len(data)))]
    share = float(torch.cat(on_data).float().mean())
    assert 0 < share < 1 and depth1_acceptance(oracle, url) == pytest.approx(share)

    follows: dict[int, Counter] = {}
    for i in range(len(data)):
        ids = data.sample(i, 512)[0].tolist()
        for a, b in zip(ids[:-1], ids[1:]):
            follows.setdefault(a, Counter())[b] += 1
    table = bigram_predictor(url)
    probe = collate([data.sample(0, 512)])
    assert any(max(c.values()) > 1 for c in follows.values())
    for token, guess in zip(probe.input_ids[0].tolist(), table(0, probe).tolist()):
        best = max(follows[token].values()) if token in follows else None
        assert (guess == -1) if best is None else follows[token][guess] == best


@pytest.mark.slow
def test_the_gpu_check_dry_run_prints_every_measurement_on_cpu():
    """bench/gpu.py is the one script a lent GPU runs; its dry run walks the same code on CPU at toy sizes,
    so the first GPU run is not the script's first run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    # its vLLM part (extract --engine vllm) is left out here: tests/test_extract_vllm.py runs that engine
    done = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--skip", "extract-vllm"], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for measurement in ("extraction ÷ bare forward", "GB/s", "Beagle stage 1", "Beagle stage 2 s=4", "EAGLE-2",
                        "chain d5", "tree d5 k4 n16", "dry run"):
        assert measurement in done.stdout, (measurement, done.stdout)
    no_gpu = subprocess.run([sys.executable, "bench/gpu.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert no_gpu.returncode == 2 and "no CUDA GPU here" in no_gpu.stderr


def test_p8_writes_the_shard_it_times_and_names_the_filesystem(tmp_path):
    """bench/store.py --p8 at toy size: the shard it times is a real one (verified), the raw file the same
    bytes; no timing is asserted."""
    from bench.store import filesystem_type, p8, shard_samples

    result = p8(64, 512, str(tmp_path), repeats=1)
    assert result["tokens"] >= 512 and result["ratio"] > 0 and result["filesystem"] == filesystem_type(str(tmp_path))
    # the hash ceiling is the raw write's time over the same bytes' hash time (BLAKE3), both measured in this run
    assert result["hash_ceiling"] == pytest.approx(result["hash_gb_s"] / result["raw_gb_s"])
    assert not list(tmp_path.iterdir())  # the timed shard and raw file are removed
    from pipeline.store.writer import write_shard
    samples = shard_samples(512, 64)
    (tmp_path / "s" / "shards").mkdir(parents=True)
    info = write_shard(str(tmp_path / "s"), 0, samples, layers=[-1], dtype="bfloat16")
    assert info["tokens"] == sum(len(s["input_ids"]) for s in samples)


@pytest.mark.slow
def test_the_extraction_ceiling_runs_the_real_path_with_a_random_state_forward(tmp_path):
    """bench/extract_ceiling.py at toy size, in its own process (its Ray hook patches the forward there):
    every token is extracted and the rates are reported; no timing is asserted."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ceiling.json"
    done = subprocess.run([sys.executable, "bench/extract_ceiling.py", "--tokens", "3000", "--width", "64",
                           "--layers", "1,2", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    from bench.store import filesystem_type

    # the workdir's filesystem, then /dev/shm's (tmpfs) where there is one
    places = [filesystem_type(str(tmp_path))] + (["tmpfs"] if os.path.isdir("/dev/shm") else [])
    assert [(r["filesystem"], r["layers"]) for r in results] == [(fs, n) for fs in places for n in (1, 2)]
    for r in results:
        assert r["tokens"] >= 3000 and r["actors"] == 1 and r["actor_tokens_per_s"] > 0 and r["raw_gb_per_s"] > 0
        assert r["state_gb"] == pytest.approx(r["tokens"] * r["layers"] * 64 * 2 / 1e9)


def test_peak_memory_tells_allocated_memory_from_a_mapped_files_pages(tmp_path):
    """A child that allocates ~160 MiB and reads every page of a mapped 96 MiB file: the resident set counts
    both, its anonymous part only the allocation (what the peer run compares two trainers on)."""
    import subprocess
    import sys

    from bench.common import PeakRss

    data = tmp_path / "mapped.bin"
    data.write_bytes(b"\x01" * (96 * 2**20))
    child = ("import mmap, sys, time\n"
             "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
             "touched = sum(m[i] for i in range(0, len(m), 4096))\n"
             "allocated = b'\\x02' * (160 * 2**20)\n"
             "time.sleep(2)\n")
    process = subprocess.Popen([sys.executable, "-c", child, str(data)])
    with PeakRss(process, interval=0.1) as peak:
        assert process.wait(timeout=60) == 0
    assert 150 <= peak.anon_mib <= 260, peak.anon_mib
    assert peak.mib - peak.anon_mib >= 80, (peak.mib, peak.anon_mib)

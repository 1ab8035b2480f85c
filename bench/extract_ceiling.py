"""The extraction ceiling (not a test): the rate above which GPUs would wait on us.

The real extraction path (`run_extract`: streamed tokenize tasks, the ShardExtractor actor with its two
overlapping shard threads, storage conversion, `write_shard` with its hashes and fsyncs, the manifest) runs
with the target's forward replaced, inside the Ray workers, by a producer of random states of the real shape
and dtype at unlimited rate (consecutive slices of one buffer of up to 1 GiB drawn at start). What is left
is everything we add around a forward. Prints, per filesystem (the workdir's disk, and /dev/shm where the
disk does not limit) and per number of captured layers, the tokens/s and GB/s of states of one actor from
its first forward to its last commit, a raw fsync'd write of the same files, the whole job's rate (actor
start and driver work included), and the ratio to what one H100 needs: an 8B target prefills ~30k
tokens/s, ~0.25 GB/s of bf16 states per layer at d = 4096.

    python bench/extract_ceiling.py [--tokens 131072] [--width 4096] [--layers 1,4] [--workers 1] [--no-tmpfs]
                                    [--store-dtype int8 --compression zstd] [--json F]

The target folder is a real Llama config of width `--width` with `max(layers)` tiny layers (1 head of 8,
MLP of 8): the driver reads and hashes it as it would any target; the actors never run it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import machine  # noqa: E402
from bench.store import filesystem_type, raw_write_seconds  # noqa: E402

H100_TOKENS_PER_SECOND = 30_000  # an 8B target's prefill on one H100, order of magnitude (issue 16)


def unlimited_forward() -> None:
    """Ray worker setup hook: TargetForward no longer loads or runs the target; each sequence's states are
    the next slice of one random bf16 buffer [n_layers, T, d] of up to 1 GiB drawn once per actor. Consecutive
    sequences take consecutive slices, so the writer hashes and writes memory that is not already in the
    CPU's caches, as it would be after a real forward."""
    import torch

    from pipeline.extract import forward

    def init(self, config):
        self.config, self.device = config, torch.device("cpu")
        architecture = json.loads((Path(config.model_path) / "config.json").read_text())
        self.num_layers = architecture["num_hidden_layers"]
        self.layers = forward.normalize_layers(config.layers, self.num_layers)
        width, vocab = architecture["hidden_size"], architecture["vocab_size"]
        self.hidden_size = width
        generator = torch.Generator().manual_seed(0)
        tokens = max(config.batch_tokens,  # 1 GiB, or 64 batches where that is less (narrow test widths)
                     min((1 << 30) // (len(self.layers) * width * 2), 64 * config.batch_tokens))
        # random bit patterns: a state's bytes, drawn 20x faster than randn (a few are NaN: never read)
        self._states = torch.randint(-(1 << 15), 1 << 15, (len(self.layers), tokens, width), dtype=torch.int16,
                                     generator=generator).view(torch.bfloat16)
        self._next = 0
        self._head = torch.randn(vocab, width, generator=generator).to(torch.bfloat16)

    def forward_batch(self, sequences):
        states = []  # n x [n_layers, L, d], views: no copy
        for sequence in sequences:
            if self._next + len(sequence) > self._states.shape[1]:
                self._next = 0
            states.append(self._states[:, self._next:self._next + len(sequence)])
            self._next += len(sequence)
        return states

    forward.TargetForward.__init__ = init
    forward.TargetForward.forward_batch = forward_batch
    forward.TargetForward.head = lambda self: {"embed_tokens": self._head, "lm_head": self._head}


def build_target(directory: Path, width: int, layers: int) -> Path:
    """A real, tiny-compute Llama of hidden size `width` (what the driver reads: config, tokenizer, weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer(directory, template=None)
    config = LlamaConfig(vocab_size=max(VOCAB_SIZE, len(tokenizer)), hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, intermediate_size=8,
                         max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def write_texts(path: Path, tokens: int, tokens_per_record: int = 1500) -> Path:
    """Base-model records of ~`tokens_per_record` tokens each (the test tokenizer: ~1 token per 2-3 bytes)."""
    words = "the quick brown fox jumps over the lazy dog hello how are you today numbers 0123456789".split()
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(max(1, tokens // tokens_per_record)):
            text = " ".join(words[(index + k) % len(words)] for k in range(tokens_per_record * 2 // 3))
            handle.write(json.dumps({"id": f"t{index}", "text": text}) + "\n")
    return path


def raw_gb_per_s(directory: Path, nbytes: int, files: int) -> float:
    """GB/s of writing `nbytes` as `files` files one after another, each fsync'd (what the store's layer files
    of its shards are), from one random buffer: what the filesystem sustains for this job's bytes."""
    size = max(1, nbytes // files)
    block = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)).cast("B")
    seconds = sum(raw_write_seconds(str(directory / "raw.bin"), [block]) for _ in range(files))
    return files * size / seconds / 1e9


def _tmpfs_has_room(state_bytes: int) -> bool:
    """Whether /dev/shm exists and can hold a store of about `state_bytes` (twice that: the texts make more
    tokens than asked, and the raw write follows the store); says so when it cannot (a container's is 64 MB)."""
    if not os.path.isdir("/dev/shm"):
        return False
    free = shutil.disk_usage("/dev/shm").free
    if free < 2 * state_bytes:
        print(f"/dev/shm has {free / 1e9:.1f} GB free, under the {2 * state_bytes / 1e9:.1f} GB the tmpfs "
              "measurement needs: skipped")
        return False
    return True


def measure(target: Path, data: Path, out: Path, layers: tuple[int, ...], workers: int, width: int,
            store_dtype: str | None = None, compression: str = "none") -> dict:
    from pipeline.extract.pipeline import ExtractConfig, run_extract

    summary = run_extract(ExtractConfig(model_path=str(target), data=(str(data),), out=str(out), layers=layers,
                                        dtype="bfloat16", max_length=2048, samples_per_shard=16,
                                        num_workers=workers, store_dtype=store_dtype, compression=compression))
    state_bytes = summary.forward_tokens * len(layers) * width * 2  # as bf16: the ratio is one of tokens/s
    per_actor = summary.actor_busy_seconds / max(summary.actors, 1)
    need = H100_TOKENS_PER_SECOND * len(layers) * width * 2
    result = {"layers": len(layers), "width": width, "tokens": summary.forward_tokens, "shards": summary.shards,
              "actors": summary.actors, "state_gb": state_bytes / 1e9,
              "actor_tokens_per_s": summary.forward_tokens / summary.actor_busy_seconds / summary.actors,
              "actor_gb_per_s": state_bytes / summary.actor_busy_seconds / summary.actors / 1e9,
              "job_tokens_per_s": summary.tokens_per_second, "actor_seconds": per_actor,
              "write_overlap_seconds": summary.write_overlap_seconds,
              "encoding": f"{store_dtype or 'bfloat16'}" + ("" if compression == "none" else f" + {compression}")}
    result["h100_ratio"] = result["actor_gb_per_s"] * 1e9 / need
    shutil.rmtree(out)
    result["filesystem"] = filesystem_type(str(out.parent))
    result["raw_gb_per_s"] = raw_gb_per_s(out.parent, state_bytes, summary.shards * len(layers))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens extracted per measurement")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", default="1,4", help="numbers of captured layers to measure")
    parser.add_argument("--workers", type=int, default=1, help="forward actors")
    parser.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir on disk)")
    parser.add_argument("--no-tmpfs", dest="tmpfs", action="store_false",
                        help="measure on the workdir's disk only (by default also in /dev/shm, where the disk "
                             "is not what limits: the ceiling of the code itself)")
    parser.add_argument("--store-dtype", default=None, choices=["float8_e4m3", "int8"],
                        help="store lossily, as extract --store-dtype (the ratio stays one of tokens/s)")
    parser.add_argument("--compression", default="none", choices=["none", "zstd"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import ray

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-ceiling-"))
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.layers.split(",")]
    target = build_target(work / "target", args.width, max(counts))
    data = write_texts(work / "texts.jsonl", args.tokens)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers + 1), include_dashboard=False,
             log_to_driver=False, runtime_env={"worker_process_setup_hook": unlimited_forward})
    encoding = (args.store_dtype or "bf16") + ("" if args.compression == "none" else f" + {args.compression}")
    print(f"{machine()}; d = {args.width}, {encoding}, {args.workers} actor(s); the forward is a random-state "
          "producer")
    print("raw GB/s: the same bytes as files of the same sizes, each written and fsync'd, on the same filesystem")
    print(f"{'filesystem':>10} {'layers':>6} {'tokens':>8} {'GB':>6} {'actor tok/s':>12} {'actor GB/s':>11} "
          f"{'raw GB/s':>9} {'job tok/s':>10} {'÷ H100 need':>12}")
    places = [work] + ([Path(tempfile.mkdtemp(prefix="bench-ceiling-", dir="/dev/shm"))]
                       if args.tmpfs and _tmpfs_has_room(args.tokens * max(counts) * args.width * 2) else [])
    results = []
    try:
        for place in places:
            for count in counts:
                layers = tuple(range(1, count)) + (-1,)  # count layers: the first count-1 and the last
                r = measure(target, data, place / f"store-{count}", layers, args.workers, args.width,
                            args.store_dtype, args.compression)
                results.append(r)
                print(f"{r['filesystem']:>10} {r['layers']:>6} {r['tokens']:>8} {r['state_gb']:>6.2f} "
                      f"{r['actor_tokens_per_s']:>12,.0f} {r['actor_gb_per_s']:>11.2f} {r['raw_gb_per_s']:>9.2f} "
                      f"{r['job_tokens_per_s']:>10,.0f} {r['h100_ratio']:>12.2f}", flush=True)
    finally:
        ray.shutdown()
        for place in places[1:]:
            shutil.rmtree(place, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

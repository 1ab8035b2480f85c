"""Prepared GPU check (not a test): extraction tokens/s and drafter training step time on one CUDA GPU.

    python bench/gpu.py              # on a machine with a CUDA GPU and the demo cache
    python bench/gpu.py --dry-run    # the same code path on CPU at toy size (checks the script, no figures)

Extraction: `extract` (Ray, one GPU actor) over the demo ShareGPT conversations, forward-stage tokens/s,
next to a bare bf16 forward of the same samples. Training: step time of Beagle stage 1 / stage 2 (s=4) and
EAGLE-2 at SmolLM2-135M shapes, bf16 autocast, allocator peak. Prints a markdown table to paste, dated.
Without a GPU (and without --dry-run) it exits with status 2 and says so.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import machine  # noqa: E402


def train_rows(device: torch.device, length: int, batch: int, repeats: int, preset: str) -> list[tuple[str, float, int]]:
    from bench.train import PRESETS, _batch, _measure, _settings
    from beagle.eagle2 import Eagle2Drafter, eagle2_loss
    from beagle.model import BeagleDrafter, DrafterConfig
    from beagle.stages import stage1_loss, stage2_loss

    cfg = DrafterConfig.from_dict(PRESETS[preset])
    emb, head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    data = _batch(cfg, batch, length, device)
    autocast = device.type == "cuda"
    rows = []
    for name, cls, fn, s in (("Beagle stage 1", BeagleDrafter, stage1_loss, 5), ("Beagle stage 2 s=4", BeagleDrafter,
                             stage2_loss, 4), ("EAGLE-2", Eagle2Drafter, eagle2_loss, 1)):
        model = cls(cfg, emb, head).to(device)
        seconds, memory = _measure(model, data, fn, _settings(5, s), device, autocast, repeats)
        rows.append((name, seconds, memory))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU at toy size, print no figures to keep")
    parser.add_argument("--limit", type=int, default=256, help="ShareGPT conversations to extract")
    parser.add_argument("--skip-extract", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.dry_run:
        print("bench/gpu.py: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --dry-run to check the script on CPU", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.dry_run else "cuda")
    print(f"{time.strftime('%Y-%m-%d')} — {machine()}{' — DRY RUN on CPU, toy sizes' if args.dry_run else ''}")
    print("| measurement | value |\n|---|---|")
    if not args.skip_extract and not args.dry_run:
        from bench.extract import bare_forward, extract

        with tempfile.TemporaryDirectory() as tmp:
            rate, tokens = extract(f"{tmp}/store", args.limit, 2048, workers=1)
            bare = bare_forward(f"{tmp}/store", threads=torch.get_num_threads())
        print(f"| extraction tokens/s ({tokens:,} tokens, 1 GPU actor) | {rate:,.0f} |")
        print(f"| bare forward tokens/s (same samples) | {bare:,.0f} (ratio {rate / bare:.2f}) |")
    length, batch, repeats, preset = (64, 1, 1, "tiny") if args.dry_run else (2048, 8, 5, "smollm2")
    for name, seconds, memory in train_rows(device, length, batch, repeats, preset):
        print(f"| {name} step, {batch} x {length} tokens | {seconds * 1e3:.1f} ms, "
              f"{batch * length / seconds:,.0f} tokens/s, {memory / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()

"""Large vocabularies (not a test): does a 262k-token LM head (Gemma 3, Llama 4 class) keep training and
drafting as fast as a 49k one when both use a draft vocabulary of 8,192 tokens?

Side by side in one run, at the demo drafter's width (SmolLM2-135M shapes, d = 576) with random weights:
- training: one optimizer step of stage 1 and of stage 2 (s = 4) on the same 2 x 512-token batch, the token
  loss over the draft vocabulary (`train --draft-vocab 8192`), median ms and tokens/s;
- drafting: one round of `build_draft_tree` after a 300-token context, chain of 3 and tree (depth 5, top-k 4,
  16 tokens), with the drafter scoring the draft vocabulary (`eval --draft-vocab 8192`), and with the whole
  vocabulary for reference, median ms.
The figure is each row's 262k ÷ 49k ratio: 1.0 means the vocabulary's size costs nothing.

    python bench/vocab.py             # ~2 minutes on 2 cores
    python bench/vocab.py --repeats 3 --rounds 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from beagle.decoding import DraftConfig  # noqa: E402
from beagle.decoding.draft_vocab import ReducedVocabDrafter  # noqa: E402
from beagle.decoding.drafters import draft_backend  # noqa: E402
from beagle.decoding.tree import build_draft_tree  # noqa: E402
from beagle.model import BeagleDrafter, DrafterConfig, restrict_loss_vocabulary  # noqa: E402
from beagle.stages import stage1_loss, stage2_loss  # noqa: E402
from bench.train import PRESETS, _batch, _measure, _settings  # noqa: E402

VOCABULARIES = (49_152, 262_144)
SHAPES = {"chain 3": DraftConfig.chain(depth=3), "tree d5 k4 n16": DraftConfig(depth=5, top_k=4, total_tokens=16)}


def _drafter(vocab: int) -> BeagleDrafter:
    torch.manual_seed(0)
    config = DrafterConfig.from_dict({**PRESETS["smollm2"], "vocab_size": vocab})
    head = torch.randn(vocab, config.hidden_size) * 0.02  # [V, d]
    return BeagleDrafter(config, head, torch.randn(vocab, config.hidden_size) * 0.02)


def train_ms(drafter: BeagleDrafter, draft_vocab: int, repeats: int) -> float:
    """Median ms of one stage-1 step plus one stage-2 (s = 4) step, the loss over `draft_vocab` tokens."""
    restrict_loss_vocabulary(drafter, torch.arange(draft_vocab))
    batch = _batch(drafter.config, 2, 512, torch.device("cpu"))
    return 1e3 * sum(_measure(drafter, batch, fn, _settings(5, s), torch.device("cpu"), False, repeats)[0]
                     for fn, s in ((stage1_loss, 5), (stage2_loss, 4)))


@torch.inference_mode()
def draft_ms(drafter: torch.nn.Module, config: DraftConfig, rounds: int, context: int = 300) -> float:
    """Median ms of one drafting round after `context` committed positions."""
    backend = draft_backend(drafter, config.concatenate)
    states = torch.randn(context, drafter.config.hidden_size)  # [L, d]
    backend.append(states, torch.arange(context), torch.randint(0, 1000, (context,)))
    times = []
    for index in range(rounds + 1):
        started = time.perf_counter()
        build_draft_tree(backend, 7, context, config)
        if index:  # the first round warms up
            times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="training steps timed per row (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=20, help="drafting rounds timed per row (after one warm-up)")
    args = parser.parse_args()
    rows: dict[str, dict[int, float]] = {}
    for vocab in VOCABULARIES:
        drafter = _drafter(vocab).eval()
        reduced = ReducedVocabDrafter(drafter, torch.arange(args.draft_vocab))
        for name, config in SHAPES.items():
            rows.setdefault(f"draft round, {name}, draft vocab {args.draft_vocab} (ms)", {})[vocab] = \
                draft_ms(reduced, config, args.rounds)
            rows.setdefault(f"draft round, {name}, whole vocabulary (ms)", {})[vocab] = \
                draft_ms(drafter, config, args.rounds)
        rows.setdefault(f"train step, stage 1 + stage 2 s=4, draft vocab {args.draft_vocab} (ms)", {})[vocab] = \
            train_ms(drafter.train(), args.draft_vocab, args.repeats)
    print(f"d = {PRESETS['smollm2']['hidden_size']}, CPU, {torch.get_num_threads()} threads, fp32")
    print(f"| row | {VOCABULARIES[0]:,} | {VOCABULARIES[1]:,} | ratio |")
    print("|---|---|---|---|")
    for name, by_vocab in rows.items():
        small, large = by_vocab[VOCABULARIES[0]], by_vocab[VOCABULARIES[1]]
        print(f"| {name} | {small:.1f} | {large:.1f} | {large / small:.2f} |")


if __name__ == "__main__":
    main()

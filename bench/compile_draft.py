"""Does `torch.compile` pay for a draft step on this CPU? (not a test; issue 37 item 4)

One draft step of the chain vLLM serves (depth 1: the root query over the drafter's cache, its logits and the
top-1 child), eager and compiled (`dynamic=True`: the cache grows every round), called alternately at
growing cache lengths; prints the compile time, whether the two agree, and the median ms of each.

    python bench/compile_draft.py --drafter RUN/drafter [--model .cache/demo/model] [--context 120]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL  # noqa: E402
from beagle.decoding.draft_vocab import select_draft_vocabulary  # noqa: E402
from beagle.decoding.generate import SpeculativeSession  # noqa: E402
from beagle.decoding.loading import load_drafter_for, load_target  # noqa: E402
from beagle.decoding.tree import DraftConfig  # noqa: E402
from beagle.prompts import eos_token_ids  # noqa: E402


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--context", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    model, tokenizer = load_target(args.model, "float32", cpu)
    drafter, meta = load_drafter_for(args.drafter, model, "float32", cpu)
    drafter, _ = select_draft_vocabulary(drafter, meta, None, [], eos_token_ids(tokenizer, model.generation_config))
    session = SpeculativeSession(model, drafter, DraftConfig.chain(depth=1), capacity=args.context + 200)
    session.prefill(torch.randint(0, 1000, (args.context,), generator=torch.Generator().manual_seed(0)))
    backend = session.backend

    def draft(tokens, positions, parent_states, keys, values, mask):
        hidden, _ = backend.step(tokens, positions, parent_states, keys, values, mask, need_bank=False)
        return torch.log_softmax(backend.logits(hidden)[0].float(), dim=-1).topk(1)  # [1, 1] log-prob, token

    def inputs(length: int):
        keys, values = (view[..., :length, :] for view in backend.cache.buffer.view())
        return (torch.tensor([[5]]), torch.tensor([[length]]), backend.root_parent_states(), keys, values,
                torch.ones(1, 1, 1, length, dtype=torch.bool))

    compiled = torch.compile(draft, dynamic=True)
    started = time.perf_counter()
    compiled(*inputs(args.context - 20))
    compiled(*inputs(args.context - 19))
    compile_seconds = time.perf_counter() - started
    eager_out, compiled_out = draft(*inputs(args.context - 10)), compiled(*inputs(args.context - 10))
    seconds = {"eager": [], "compiled": []}
    for index in range(args.repeats):
        for name, function in (("eager", draft), ("compiled", compiled)):
            step_inputs = inputs(args.context - 20 + index % 20)
            started = time.perf_counter()
            function(*step_inputs)
            seconds[name].append(time.perf_counter() - started)
    eager_ms, compiled_ms = (1000 * statistics.median(seconds[name]) for name in ("eager", "compiled"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {args.threads} thread(s): compile {compile_seconds:.0f} s; same token: "
          f"{torch.equal(eager_out[1], compiled_out[1])}; draft step eager {eager_ms:.2f} ms, compiled "
          f"{compiled_ms:.2f} ms ({eager_ms / compiled_ms:.2f}x)")


if __name__ == "__main__":
    main()

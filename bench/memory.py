"""P4 (not a test): memory kept for backward by stage 2 at s=4 ÷ s=1, next to the EAGLE-3 style
training-time-test loop's (bench/ttt.py), same model, same batch, same run.

On CUDA this is the allocator peak of forward + backward above the model; on CPU the bytes autograd
saves for backward (bench/profiling.py), which is what grows with the steps. SmolLM2-135M shapes,
random weights and states (memory does not depend on values).

    python bench/memory.py [--quick] [--length 512] [--batch 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import emit, record  # noqa: E402
from bench.profiling import count_saved_bytes  # noqa: E402
from bench.ttt import ttt_loss  # noqa: E402
from beagle.data import Batch  # noqa: E402
from beagle.model import BeagleDrafter, DrafterConfig  # noqa: E402
from beagle.stages import StageSettings, stage2_loss  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
               vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5)


def measure(model, batch, loss_fn, settings, device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with count_saved_bytes(model) as saved:
        loss = loss_fn(model, batch, 0, settings).finish().loss
    if device.type == "cuda":
        loss.backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base
    return saved.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 tokens instead of 512")
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    L = args.length or (256 if args.quick else 512)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_dict(SMOLLM2)
    model = BeagleDrafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02,
                          torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(device)
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, cfg.vocab_size, (args.batch, L), generator=g),
                  torch.rand(args.batch, L, generator=g) < 0.6, torch.randn(args.batch, L, cfg.hidden_size, generator=g) * 2,
                  torch.full((args.batch,), L)).to(device)
    rows = {}
    for name, fn, recompute in (("stage 2", stage2_loss, True), ("stage 2 no recompute", stage2_loss, False),
                                ("EAGLE-3 style TTT", ttt_loss, False)):
        rows[name] = [measure(model, batch, fn, StageSettings(window_size=5, simulation_steps=s, noise_std=0.2,
                                                              regression_weight=10.0, vocab_chunk=8192,
                                                              recompute=recompute), device)
                      for s in (1, 2, 3, 4)]
        print(f"{name:<22}" + "".join(f"{b / 2**20:>10.1f}" for b in rows[name]) + "  MiB at s=1..4")
    kind = "peak allocated" if device.type == "cuda" else "saved for backward"
    s2, ttt = rows["stage 2"], rows["EAGLE-3 style TTT"]
    settings = {"shapes": "SmolLM2-135M", "batch": f"{args.batch} x {L}", "window_size": 5, "memory": kind}
    emit([record("P4", "stage-2 memory s=4 ÷ s=1 (TTT alongside)", s2[3] / s2[0], 1.15, "<=",
                  f"Beagle {s2[3] / s2[0]:.2f}x ({s2[0] / 2**20:.0f}→{s2[3] / 2**20:.0f} MiB); "
                  f"TTT {ttt[3] / ttt[0]:.2f}x ({ttt[0] / 2**20:.0f}→{ttt[3] / 2**20:.0f} MiB); "
                  f"no recompute {rows['stage 2 no recompute'][3] / rows['stage 2 no recompute'][0]:.2f}x",
                  settings,
                  why="each step's loss is computed inside its recomputed block, so nothing per trained row is "
                      "kept; what still grows is the predicted-key bank (one step's keys and values, ≤ L slots "
                      "in all), larger relative to the rest with short sequences or many KV heads")], args.json)


if __name__ == "__main__":
    main()

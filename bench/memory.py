"""P4 (not a test): memory kept for backward by stage 2 at s=4 ÷ s=1, next to the EAGLE-3 style
training-time-test loop's (bench/ttt.py), same model, same batch, same run. P13: the engine-form Beagle
(docs/method.md §9) ÷ the EAGLE-2 baseline at the same batch, in training (each one's heaviest stage) and in
drafting (trained weights plus the draft cache over the same context), the paper's 10-15% less memory.

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
from beagle.decoding.drafters import draft_backend  # noqa: E402
from beagle.eagle2 import Eagle2Drafter, eagle2_loss  # noqa: E402
from beagle.losses import GPU_VOCAB_CHUNK  # noqa: E402
from beagle.model import BeagleDrafter, DrafterConfig  # noqa: E402
from beagle.stages import StageSettings, stage1_loss, stage2_loss  # noqa: E402
from beagle.state_beagle import StateBeagleDrafter  # noqa: E402

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


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def drafting_bytes(model, states, tokens, device) -> int:
    """Memory a drafter holds to draft after a context: its trained weights (the target's embedding and head
    are shared, not counted) plus its cache over the context, on CUDA the allocator peak of the prefill and one
    draft step instead."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - _tensor_bytes(model.parameters())
    with torch.no_grad():
        backend = draft_backend(model)
        backend.append(states, torch.arange(states.shape[0], device=device), tokens)
        keys, values = backend.keys(), backend.values()
        mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool, device=device)
        backend.step(tokens[None, -1:], torch.tensor([[states.shape[0]]], device=device),
                     backend.root_parent_states(), keys, values, mask, need_bank=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    cache = backend.cache
    return _tensor_bytes(model.parameters()) + _tensor_bytes([cache.keys, cache.values,
                                                             getattr(cache, "last_state", None)])


def engine_form_records(batch: Batch, cfg: DrafterConfig, key_layers: tuple[int, ...], device) -> list[dict]:
    """P13: engine-form Beagle ÷ EAGLE-2 memory, training and drafting, with keys from `key_layers` (the state
    form's aux layers; EAGLE-2 fuses as many layers, the last one -1)."""
    d = cfg.hidden_size
    n = len(key_layers)
    head = (torch.randn(cfg.vocab_size, d) * 0.02).to(device), (torch.randn(cfg.vocab_size, d) * 0.02).to(device)
    state = StateBeagleDrafter(DrafterConfig.from_dict({**cfg.to_dict(), "key_layers": list(key_layers),
                                                        "residual": "state"}), *head).to(device)
    eagle_layers = (-1,) if n == 1 else (*key_layers[:-1], -1)
    eagle = Eagle2Drafter(DrafterConfig.from_dict({**cfg.to_dict(), "key_layers": list(eagle_layers)}), *head).to(device)
    B, L = batch.input_ids.shape
    g = torch.Generator().manual_seed(1)
    key_states = (torch.randn(B, L, n * d, generator=g) * 2).to(device)
    both = Batch(batch.input_ids, batch.loss_mask, batch.hidden, batch.lengths, key_states=key_states)
    eagle_batch = both if n > 1 else batch
    settings = StageSettings(window_size=5, simulation_steps=4, noise_std=0.2, regression_weight=10.0,
                             vocab_chunk=GPU_VOCAB_CHUNK, recompute=True)
    state_batch = both if n > 1 else Batch(batch.input_ids, batch.loss_mask, batch.hidden, batch.lengths,
                                           key_states=key_states)
    train_state = max(measure(state, state_batch, fn, settings, device) for fn in (stage1_loss, stage2_loss))
    train_eagle = measure(eagle, eagle_batch, eagle2_loss, settings, device)
    draft_state = drafting_bytes(state, key_states[0], batch.input_ids[0], device)
    draft_eagle = drafting_bytes(eagle, (key_states if n > 1 else batch.hidden)[0], batch.input_ids[0], device)
    kind = "peak allocated" if device.type == "cuda" else "saved for backward; weights + cache"
    settings_record = {"shapes": "SmolLM2-135M", "batch": f"{B} x {L}", "key_layers": list(key_layers),
                       "memory": kind}
    why = ("the engine form carries fc and an output norm like EAGLE-3; its saving over EAGLE-2 is the "
           "token-state fusion it does not have (d x d against 2d x d)")
    return [
        record("P13", f"memory engine-form Beagle ÷ EAGLE-2, training, {n} key layer(s)", train_state / train_eagle,
               0.90, "<=", f"{train_state / 2**20:.0f} vs {train_eagle / 2**20:.0f} MiB (heaviest stage: stage 1 or "
               "stage 2 at s=4, against EAGLE-2's teacher-forced pass)", settings_record, why=why),
        record("P13", f"memory engine-form Beagle ÷ EAGLE-2, drafting, {n} key layer(s)", draft_state / draft_eagle,
               0.90, "<=", f"{draft_state / 2**20:.1f} vs {draft_eagle / 2**20:.1f} MiB over a {L}-token context",
               settings_record, why=why),
    ]


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
                                                              regression_weight=10.0, vocab_chunk=GPU_VOCAB_CHUNK,
                                                              recompute=recompute), device)
                      for s in (1, 2, 3, 4)]
        print(f"{name:<22}" + "".join(f"{b / 2**20:>10.1f}" for b in rows[name]) + "  MiB at s=1..4")
    kind = "peak allocated" if device.type == "cuda" else "saved for backward"
    engine = [r for layers in ((29,), (2, 15, 27)) for r in engine_form_records(batch, cfg, layers, device)]
    for r in engine:
        print(f"{r['name']}: {r['ratio']:.3f} ({r['value_text']})")
    s2, ttt = rows["stage 2"], rows["EAGLE-3 style TTT"]
    settings = {"shapes": "SmolLM2-135M", "batch": f"{args.batch} x {L}", "window_size": 5, "memory": kind}
    emit([record("P4", "stage-2 memory s=4 ÷ s=1 (TTT alongside)", s2[3] / s2[0], 1.15, "<=",
                  f"Beagle {s2[3] / s2[0]:.2f}x ({s2[0] / 2**20:.0f}→{s2[3] / 2**20:.0f} MiB); "
                  f"TTT {ttt[3] / ttt[0]:.2f}x ({ttt[0] / 2**20:.0f}→{ttt[3] / 2**20:.0f} MiB); "
                  f"no recompute {rows['stage 2 no recompute'][3] / rows['stage 2 no recompute'][0]:.2f}x",
                  settings,
                  why="each step's loss is computed inside its recomputed block, so nothing per trained row is "
                      "kept; what still grows is the predicted-key bank (one step's keys and values, ≤ L slots "
                      "in all), larger relative to the rest with short sequences or many KV heads"), *engine],
         args.json)


if __name__ == "__main__":
    main()

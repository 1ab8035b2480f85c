"""Fused multi-layer keys: a drafter whose keys fuse several captured target layers (EAGLE-3 style input).

The learning test uses a synthetic target in the style of tests/test_learning.py, where the next token is
readable only from a MIDDLE layer: the last layer at position i holds A[t_{i+1}] (so the LM head reads the
next token there, as a real target's last layer does), and the middle layer holds B[t_{i+2}]. A depth-1
query at i (token t_i) predicts t_{i+1}; its newest key is position i-1, whose last-layer state A[t_i]
only repeats the query token, while its middle-layer state B[t_{i+1}] is the answer. Tokens are uniformly
random, so nothing else helps: the fused drafter must learn it, the last-layer drafter cannot.
"""
import json

import pytest
import torch

from beagle.data import StoreSet, collate
from beagle.decoding import DraftConfig, plain_generate, speculative_generate
from beagle.drafter_folder import load_drafter
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.stages import StageSettings, stage1_loss
from beagle.train_config import TrainConfig
from beagle.trainer import train
from pipeline.extract.state_encoding import write_store
from tests.tiny_store import build_tiny_store, tiny_target

VOCAB, WIDTH, LENGTH, CODE_NORM = 32, 64, 32, 8.0
STEPS, LR, BATCH_ROWS = 200, 3e-3, 16
NEAR_CHANCE = 3.0 / VOCAB
ARCH = dict(hidden_size=WIDTH, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=VOCAB, rope_theta=10000.0, rms_norm_eps=1e-6, num_hidden_layers=2,
            max_position_embeddings=256)
DEPTH1 = StageSettings(window_size=1, simulation_steps=1, noise_std=0.0, regression_weight=10.0, vocab_chunk=8192)


def _codes(seed: int = 0) -> dict[str, torch.Tensor]:
    """Orthonormal LM-head rows (A, scaled) and a code B in their orthogonal complement."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=g))      # [d, d]
    lm_head = basis[:VOCAB].clone()                                           # [V, d]
    b = torch.randn(VOCAB, WIDTH - VOCAB, generator=g) @ basis[VOCAB:]       # [V, d]
    return {"embed_tokens": torch.randn(VOCAB, WIDTH, generator=g), "lm_head": lm_head,
            "A": CODE_NORM * lm_head, "B": CODE_NORM * b / b.norm(dim=1, keepdim=True)}


def _write_middle_layer_store(path, codes: dict[str, torch.Tensor], num_samples: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        tokens = torch.randint(0, VOCAB, (LENGTH + 2,), generator=g)
        middle = codes["B"][tokens[2:]]                                       # [L, d]: knows t_{i+2}
        last = codes["A"][tokens[1:LENGTH + 1]]                               # [L, d]: LM head reads t_{i+1}
        samples.append({"sample_id": f"s{seed}-{i}", "input_ids": tokens[:LENGTH],
                        "loss_mask": torch.ones(LENGTH, dtype=torch.bool),
                        "hidden_states": torch.stack([middle, last])})
    write_store(str(path), samples, head={"embed_tokens": codes["embed_tokens"], "lm_head": codes["lm_head"]},
                target={"name": "synthetic-middle-layer", "config_sha256": "0" * 64, "weights_sha256": "0" * 64,
                        "architecture": ARCH},
                tokenizer={"name": "none", "vocab_size": VOCAB},
                capture={"layers": [1, -1], "dtype": "float32", "max_length": LENGTH},
                source={"name": "uniform-random", "seed": seed, "num_samples": num_samples})
    return str(path)


def _train_depth1(data: StoreSet, fused: bool) -> BeagleDrafter:
    """The trainer's step (AdamW, clip 0.5) on plain causal attention (window 1), without the CLI."""
    torch.manual_seed(0)
    head = data.load_head()
    config = DrafterConfig(**{k: v for k, v in ARCH.items() if k in DrafterConfig.__dataclass_fields__},
                           key_layers=data.key_layers if fused else (-1,))
    model = BeagleDrafter(config, head["embed_tokens"], head["lm_head"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        rows = torch.randint(0, len(data), (BATCH_ROWS,), generator=g).tolist()
        batch = collate([data.sample(i, LENGTH) for i in rows])
        result = stage1_loss(model, batch, 0, DEPTH1).finish()
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return model.eval()


def _depth1_accuracy(model: BeagleDrafter, data: StoreSet) -> float:
    with torch.no_grad():
        batch = collate([data.sample(i, LENGTH) for i in range(len(data))])
        result = stage1_loss(model, batch, 0, DEPTH1).finish()
    assert int(result.count[0]) >= 500
    return float(result.correct[0]) / float(result.count[0])


@pytest.mark.slow
def test_fused_keys_read_a_middle_layer_that_the_last_layer_drafter_cannot(tmp_path):
    codes = _codes()
    train_store = StoreSet([_write_middle_layer_store(tmp_path / "train", codes, 256, seed=1)], fuse_layers=True)
    held_out = StoreSet([_write_middle_layer_store(tmp_path / "test", codes, 32, seed=2)], fuse_layers=True)
    assert train_store.key_layers == (1, -1)
    fused = _depth1_accuracy(_train_depth1(train_store, fused=True), held_out)
    last_only = _depth1_accuracy(_train_depth1(train_store, fused=False), held_out)
    assert fused >= 0.9, f"fused drafter depth-1 top-1 {fused:.3f}: it does not read the middle layer"
    assert last_only <= NEAR_CHANCE, f"last-layer drafter depth-1 top-1 {last_only:.3f}: the task leaks"


def test_fusing_a_single_layer_store_is_refused_with_the_fix(tmp_path):
    store = build_tiny_store(tmp_path / "one", num_samples=4)
    with pytest.raises(ValueError, match=r"captured only layer\(s\) \[-1\].*--layers 8,16,-1"):
        StoreSet([store], fuse_layers=True)


FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2, checkpoint_every=100,
            vocab_chunk=128, stage1_epochs=1, stage2_epochs=1, max_steps=6, bf16=False, fuse_layers=True)
SHAPES = {"chain": DraftConfig.chain(depth=3), "tree": DraftConfig(depth=3, top_k=3, total_tokens=8)}


@pytest.mark.parametrize("drafter_type", ["beagle", "eagle2"])
def test_multi_layer_store_trains_exports_and_decodes_exactly(tmp_path, drafter_type):
    """Layers (1, -1) captured from a real tiny target: train (both stages) -> export -> greedy decoding with
    the fused drafter equals plain decoding, chain and tree."""
    store = build_tiny_store(tmp_path / "store", num_samples=12, layers=(1, -1))
    run = tmp_path / "run"
    train([store], run, TrainConfig(**FAST, drafter=drafter_type))
    meta = json.loads((run / "drafter" / "config.json").read_text())
    assert meta["key_layers"] == [1, -1] and meta["drafter_type"] == drafter_type

    target = tiny_target(0)                                                   # the store's target
    drafter, _ = load_drafter(run / "drafter", embed_tokens=target.get_input_embeddings().weight,
                              lm_head=target.get_output_embeddings().weight)
    assert drafter.config.key_layers == (1, -1) and drafter.layer_fusion is not None
    prompt = torch.tensor([3, 7, 11, 12, 14])
    plain = plain_generate(target, prompt, 20, set()).tokens
    for name, shape in SHAPES.items():
        spec = speculative_generate(target, drafter, prompt, 20, set(), shape)
        assert spec.tokens == plain, name

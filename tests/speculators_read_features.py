"""Run inside .venv-speculators: read an export-features folder with speculators' own training reader
(`speculators.train.data.ArrowDataset`, the class `python -m speculators.train` builds from --data-path) and
write what it yields for every sample, so tests/test_export_features.py can compare it with our store.

    python speculators_read_features.py DATA_DIR MAX_LEN OUT.safetensors
"""
import sys

import torch
from safetensors.torch import save_file
from speculators.train.data import ArrowDataset
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution  # noqa: F401 (importable)

data_dir, max_len, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dataset = ArrowDataset(max_len, data_dir, on_missing="raise")
tensors = {}
for index in range(len(dataset)):
    sample = dataset[index]
    if not isinstance(sample, dict):
        raise SystemExit(f"sample {index}: speculators' reader gave {sample!r}")
    for key in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states"):
        tensors[f"{index}.{key}"] = sample[key].contiguous()
tensors["approx_lengths"] = torch.tensor(dataset.approx_lengths, dtype=torch.long)
freq = torch.load(f"{data_dir}/token_freq.pt")
tensors["token_freq"] = torch.tensor(sorted(freq.items()), dtype=torch.long).reshape(-1, 2)
save_file(tensors, out)
print(f"read {len(dataset)} samples")

"""Draft logits of exported EAGLE-3 folders as speculators 0.9.0's own Eagle3DraftModel computes them.

Run by tests/test_engine_export.py under .venv-speculators (`make speculators-venv`): speculators pins
transformers <= 5.19, which the project's venv cannot hold. It imports only speculators, torch, safetensors
and json, and follows speculators' own loader and forward: `Eagle3DraftModel.from_pretrained` (the verifier's
embedding where the folder has none), then `forward(hidden_states, input_ids, document_ids, ttt_steps=K)`,
which fuses the aux states by `fc`, runs the layer over every row, feeds each step's (pre-norm) output back
as the next step's state, with the next true token and position + 1, attending over earlier steps' keys of
the same row. The LM head's output of each step is captured by a forward hook.

    python tests/speculators_reference.py INPUTS OUT EXPORT_DIR [EXPORT_DIR ...]

INPUTS: safetensors with hidden_states [1, L, n*d] (aux states of rows r = 0..L-1), input_ids [1, L] (row r
carries token t_{r+1}) and ttt_steps [1]. OUT: safetensors with "{i}.logits" [ttt_steps, L, N] for the
i-th export folder, and a JSON line per folder on stdout saying how it loaded.
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def draft_logits(export_dir: str, hidden_states: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
    if torch.isnan(model.embed_tokens.weight).any():
        raise SystemExit(f"{export_dir}: speculators left embed_tokens unloaded (NaN)")
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach()))
    length = input_ids.shape[1]
    with torch.no_grad():
        model(hidden_states=hidden_states, input_ids=input_ids,
              document_ids=torch.zeros(1, length, dtype=torch.long), ttt_steps=steps)
    print(json.dumps({"export": export_dir, "draft_vocab_size": model.draft_vocab_size,
                      "use_draft_vocab": bool(model.use_draft_vocab), "attn": model._attn_impl,
                      "norm_before_residual": bool(model.config.norm_before_residual),
                      "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids)}))
    return torch.cat(captured)  # [steps, L, N]


def main() -> None:
    inputs_path, out_path, *exports = sys.argv[1:]
    inputs = load_file(inputs_path)
    steps = int(inputs["ttt_steps"][0])
    results = {f"{i}.logits": draft_logits(path, inputs["hidden_states"].float(), inputs["input_ids"], steps)
               for i, path in enumerate(exports)}
    save_file({k: v.contiguous() for k, v in results.items()}, out_path)


if __name__ == "__main__":
    main()

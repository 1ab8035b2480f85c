"""The vLLM engine of `regenerate --engine vllm` and `extract --engine vllm`, as a worker process.

Runs under the vLLM environment's interpreter (`--vllm-python`; `make serve-venv` builds `.venv-vllm`), which
need not have this project: this file imports only the standard library and vLLM, and the actors
(`pipeline/jobkit/vllm_process.py`) start it as `PYTHON beagle_vllm_worker.py ...`. The actor renders the chat
template, decides what is asked and decodes the answers exactly as the transformers engine does; this
process only runs `vllm.LLM.generate` over the token ids of one round of prompts at a time (continuous
batching, paged attention, `max_num_seqs` rows in flight).

Two modes. Generation (regenerate): token ids in, token ids out. Hidden states (extract, `--hidden-states
IDS --scratch DIR`): vLLM's `extract_hidden_states` speculative method caches the states of the aux layers
IDS (vLLM's numbering: i = the residual stream entering decoder layer i, n = the last layer's output before
the final norm) for every prompt token, and our connector (`beagle_hidden_states_connector.py`, loaded by
vLLM from this folder) writes each prompt's states to `DIR/<request>.safetensors`; the actor reads them.

Protocol, one JSON object a line: on start the worker writes `{"ready": {"vllm": VERSION, ...}}` or
`{"error": "..."}`; then for each request line `{"prompts": [[ids]], "seeds": [int|null], "max_tokens",
"temperature", "top_p", "stop_token_ids"}` it writes `{"outputs": [[ids]]}` (each answer's token ids as vLLM
returns them, a stop token included) or `{"error": "..."}`; in the hidden-states mode, for `{"prefill": [[ids]]}`
it writes `{"files": [path]}`, one complete safetensors file per prompt, in prompt order. The protocol goes over a private copy of fd 1;
fd 1 itself is pointed at stderr, so whatever vLLM and its engine process print lands in the log, never in
the protocol. `--probe` prints `{"vllm": VERSION, "supported": bool, "architectures": [...]}` and exits,
without loading weights: the driver's check that the environment and the architecture are usable.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--probe", action="store_true", help="print the vLLM version and architecture support; exit")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens a step (default: vLLM's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--executor", default=None, choices=["mp", "ray", "uni"],
                   help="vLLM's distributed_executor_backend (default: vLLM's choice)")
    p.add_argument("--ray-address", default=None, help="Ray cluster the ray executor joins")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="default: vLLM's on a GPU, 0.3 on a CPU (the share of host memory it wants free)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--hidden-states", default=None, metavar="IDS",
                   help="comma-separated aux layer ids (vLLM's numbering): run the hidden-states mode")
    p.add_argument("--scratch", default=None, help="the folder the hidden-states files are written to")
    return p.parse_args(argv)


CONNECTOR = "BeagleHiddenStatesConnector"


def hidden_states_options(layer_ids: list[int], scratch: str) -> dict:
    """LLM(...) options of the hidden-states mode: vLLM's extract_hidden_states method (one "draft" token,
    the sampled one, always accepted) and our connector, which writes every finished prompt's states."""
    return {"speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": layer_ids}}},
            "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                                   "kv_connector_module_path": "beagle_hidden_states_connector",
                                   "kv_connector_extra_config": {"shared_storage_path": scratch}},
            # each prompt is computed whole: no state is read back from another prompt's cached prefix
            "enable_prefix_caching": False}


def written_file(output) -> str:
    """The safetensors file of one finished prompt, once complete: the connector holds its `.lock`
    exclusively until the file is written (and renamed into place)."""
    import fcntl

    path = (output.kv_transfer_params or {}).get("hidden_states_path")
    if not path:
        raise RuntimeError(f"request {output.request_id}: vLLM returned no hidden_states_path")
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer releases it
    os.remove(path + ".lock")
    if not os.path.isfile(path):
        raise RuntimeError(f"request {output.request_id}: the connector did not write {path} (see the log)")
    return path


def probe(model: str, trust_remote_code: bool) -> dict:
    """vLLM's version and whether its model registry runs every architecture the config names."""
    import vllm
    from vllm import ModelRegistry

    with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
        architectures = json.load(handle).get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    return {"vllm": vllm.__version__, "architectures": architectures,
            "supported": bool(architectures) and all(a in supported for a in architectures),
            "trust_remote_code": trust_remote_code}


def serve(args: argparse.Namespace, protocol) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU; ignored on a GPU
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    def send(obj: dict) -> None:
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    on_cpu = current_platform.is_cpu()
    if args.executor == "ray" and args.ray_address:
        import ray  # the cluster's Ray version, installed in the vLLM environment

        ray.init(address=args.ray_address, ignore_reinit_error=True)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    positions = (config.get("text_config") or config).get("max_position_embeddings")
    # prompt + answer, never past the model's positions (an answer reaching them ends there, unfinished)
    max_model_len = min(args.max_model_len, positions) if positions else args.max_model_len
    options = {"gpu_memory_utilization": args.gpu_memory_utilization or (0.3 if on_cpu else None),
               "distributed_executor_backend": args.executor, "max_num_batched_tokens": args.max_num_batched_tokens}
    layer_ids = [int(x) for x in args.hidden_states.split(",")] if args.hidden_states else None
    if layer_ids is not None:
        options.update(hidden_states_options(layer_ids, args.scratch))
    try:
        llm = LLM(model=args.model, tokenizer=args.model, skip_tokenizer_init=True, dtype=args.dtype,
                  max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  trust_remote_code=args.trust_remote_code, seed=args.seed, enforce_eager=on_cpu,
                  **{k: v for k, v in options.items() if v is not None})
        # One token now, so that a model the kernels cannot run (a head size vLLM's CPU attention lacks)
        # fails while starting, with its reason, rather than on the first chunk.
        [warm] = llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1, detokenize=False),
                              use_tqdm=False)
        if layer_ids is not None:
            os.remove(written_file(warm))  # the states of the probe token: in our scratch folder, ours
    except Exception as error:  # noqa: BLE001 - reported to the actor as one line, the traceback in the log
        import traceback

        traceback.print_exc()
        send({"error": f"vLLM {vllm.__version__} could not start the model: {_root_cause(error)}"})
        return 1
    send({"ready": {"vllm": vllm.__version__, "platform": "cpu" if on_cpu else current_platform.device_name,
                    "load_seconds": round(time.perf_counter() - started, 1)}})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if "prefill" in request:
            send(prefill(llm, SamplingParams, request["prefill"]))
            continue
        try:
            params = [SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                                     top_p=request["top_p"], seed=seed, stop_token_ids=request["stop_token_ids"],
                                     detokenize=False)
                      for seed in request["seeds"]]
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
        except Exception as error:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            send({"error": f"vLLM generate failed: {type(error).__name__}: {error}"})
            continue
        send({"outputs": [list(output.outputs[0].token_ids) for output in outputs]})
    if args.scratch and os.path.basename(os.path.normpath(args.scratch)).startswith("beagle-vllm-states-"):
        import shutil  # the actor's own scratch folder (its mkdtemp prefix), left over if the actor died

        shutil.rmtree(args.scratch, ignore_errors=True)
    return 0


def prefill(llm, sampling_params, prompts: list[list[int]]) -> dict:
    """Every prompt through the target once (one token sampled, the states of every prompt token kept):
    {"files": [one safetensors file per prompt, in prompt order]} or {"error": ...}."""
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                               sampling_params(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
        return {"files": [written_file(output) for output in outputs]}
    except Exception as error:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        return {"error": f"vLLM prefill failed: {type(error).__name__}: {error}"}


def _root_cause(error: BaseException) -> str:
    """The innermost exception's first line: vLLM wraps a worker's error in EngineDeadError and the like."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and "validation error" in lines[0]:  # pydantic: the reason is the second line
        lines = [lines[1].removeprefix("Value error, ")]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # vLLM's prints (and its engine process's, which inherits fd 1) go to the log
    sys.stdout = sys.stderr
    if args.probe:
        try:
            report = probe(args.model, args.trust_remote_code)
        except ImportError as error:
            report = {"error": f"{sys.executable} cannot import vLLM ({error})"}
        protocol.write(json.dumps(report) + "\n")
        protocol.flush()
        return 0
    return serve(args, protocol)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    sys.exit(main())

"""P15: our drafter beside the one a user would train with speculators, on the same features, served in vLLM.

    python bench/peer.py --quick                    # <= 15 minutes on 2 cores; last line `P15 <ratio at k=3>`
    python bench/peer.py                            # the full run of docs/benchmarks.md (k = 1, 2, 3)
    python bench/peer.py --prompts FILE             # serve other held-out prompts (MT-Bench's by default)

One target (the demo's), one self-distilled store, one token budget and one number of optimizer steps:

1. data: `beagle-pipeline regenerate` lets the target answer ShareGPT prompts, `beagle-pipeline extract` with
   its default layers (EAGLE-3's three aux layers and -1) stores the states once, for both trainers;
2. ours: `beagle-pipeline train --residual state` (the engine-form Beagle, the demo's recipe), then
   `beagle-pipeline export --format eagle3`;
3. theirs: `beagle-pipeline export-features --format speculators` writes the store as speculators' samples,
   and speculators' own trainer (`python -m speculators.train`, its documented defaults: Muon, lr 1e-3, a
   linear schedule, 3 TTT steps, KL loss) trains its EAGLE-3 drafter from them with the same
   `--max-steps` and the same tokens per step (`--total-seq-len` = our `--batch-tokens`). Its trainer
   puts every batch on CUDA device 0; bench/speculators_cpu.py runs the same CLI with that device set to the
   CPU (the one change, said in the results);
4. both drafters are served by vLLM (CPU build, `make serve-venv`) on the held-out prompts, greedy, fp32, at
   each `num_speculative_tokens`, beside a plain run on the same prompts.

P15 = our vLLM acceptance length / speculators' at each k; also each one's speedup over plain vLLM, whether
its answers equal plain decoding, the training wall-time ratio (ours / theirs) and the peak-memory ratio
(resident set of the training process tree, sampled). Every command is written into the results (JSON, with
`--out`), rewritten after each step, so an interrupted run keeps what it measured; a rerun reuses the data
steps (regenerate and extract resume) and retrains. A benchmark measures: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (DEMO_MODEL, DEMO_QUESTIONS, DEMO_SHAREGPT, ROOT, PeakRss, machine,  # noqa: E402
                          require_demo)
from bench.serve import VLLM_PYTHON, compare, run_vllm  # noqa: E402

SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
SPECULATORS_CPU = Path(__file__).resolve().parent / "speculators_cpu.py"


@dataclass(frozen=True)
class PeerSize:
    """How much of each step the run does; the two trainers always get the same `steps` x `batch_tokens`."""

    name: str
    prompts: int              # ShareGPT first prompts the target answers (the training data)
    max_new_tokens_answer: int
    max_length: int           # tokens per conversation, both trainers
    steps: int                # optimizer steps, both trainers
    batch_tokens: int         # tokens per optimizer step, both trainers
    serve_prompts: int        # held-out prompts served in vLLM
    max_new_tokens: int       # per served answer
    ks: tuple[int, ...]       # num_speculative_tokens served
    draft_vocab: int = 8192   # both drafters draft over the 8,192 most frequent tokens


SIZES = {
    "quick": PeerSize("quick", prompts=120, max_new_tokens_answer=128, max_length=512, steps=60, batch_tokens=4096,
                      serve_prompts=8, max_new_tokens=48, ks=(3,)),
    "full": PeerSize("full", prompts=800, max_new_tokens_answer=192, max_length=1024, steps=300, batch_tokens=2048,
                     serve_prompts=40, max_new_tokens=64, ks=(1, 2, 3)),
}


def beagle_pipeline() -> list[str]:
    """`beagle-pipeline` with this interpreter: the console script next to it, or `-c`."""
    script = Path(sys.executable).with_name("beagle-pipeline")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from pipeline.cli import main; main(prog_name='beagle-pipeline')"]


def measured_run(cmd: list[str], log_path: Path, *, env: dict | None = None, interval: float = 0.25) -> dict:
    """Run `cmd` to completion with its output in `log_path`: wall seconds, exit code and the peak resident
    set of its whole process tree (dataloader workers included), sampled every `interval` seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        with PeakRss(process, interval) as peak:
            rc = process.wait()
    seconds = time.perf_counter() - started
    result = {"command": shlex.join(cmd), "seconds": seconds, "returncode": rc, "peak_rss_mib": peak.mib,
              "peak_anon_mib": peak.anon_mib, "log": str(log_path)}
    if rc != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{shlex.join(cmd)} failed with exit code {rc} (log {log_path}):\n{tail}")
    return result


def cli_env() -> dict:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def speculators_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
    return env


def target_dtype(requested: str) -> str:
    """The dtype the target generates and extracts in: `requested`, or with "auto" bf16 where the hardware
    multiplies it natively (a GPU, a CPU with AMX or AVX512-BF16) and fp32 elsewhere. The demo's rule
    (pipeline/demo/run.py): on an AVX2-only CPU torch and vLLM emulate bf16 (vLLM regenerated ~35 tokens/s in
    bf16 on a 2-core AMD EPYC, 2026-12-07, against ~325 on a Xeon with AMX). The store keeps that dtype, and
    speculators' trainer autocasts to its states' dtype, so both trainers compute in it."""
    import torch

    from beagle.precision import resolve_target_dtype

    return resolve_target_dtype(requested, on_gpu=torch.cuda.is_available())


def recorded_target_dtype(results: dict) -> str:
    """The target dtype an earlier run's results were made in: runs before it was recorded used bf16."""
    return results.get("target_dtype", "bfloat16")


def data_commands(size: PeerSize, out: Path, target: Path, sharegpt: Path, engine: str = "hf",
                  dtype: str = "bfloat16") -> list[tuple[str, list[str]]]:
    """regenerate (the target answers `size.prompts` ShareGPT first turns with `engine`), extract, and
    export-features: the one store both trainers read, in `dtype`."""
    cli = beagle_pipeline()
    return [
        ("regenerate", [*cli, "regenerate", "--model", str(target), "--data", str(sharegpt),
                        "--out", str(out / "answers.jsonl"), "--limit", str(size.prompts), "--max-turns", "1",
                        "--max-new-tokens", str(size.max_new_tokens_answer), "--max-prompt-length", "256",
                        "--dtype", dtype, "--engine", engine, "--no-progress"]),
        ("extract", [*cli, "extract", "--model", str(target), "--data", str(out / "answers.jsonl"),
                     "--out", str(out / "store"), "--max-length", str(size.max_length), "--dtype", dtype,
                     "--no-progress"]),
        ("export-features", [*cli, "export-features", str(out / "store"), "--format", "speculators",
                             "--model", str(target), "--out", str(out / "speculators-data"), "--force",
                             "--no-progress"]),
    ]


def stage_epochs(store: Path, size: PeerSize) -> tuple[int, int]:
    """Stage-1 and stage-2 epochs whose batches cover `size.steps` at the demo's 2:1 split (8 and 4 epochs
    there), so that `--max-steps` ends our run inside stage 2 rather than before it."""
    from beagle.data import plan_epoch
    from beagle.torch_store import open_store

    lengths = open_store(str(store)).lengths
    per_epoch = len(plan_epoch(lengths, batch_tokens=size.batch_tokens, limit=size.max_length, seed=0, epoch=0))
    stage1 = max(1, round(2 * size.steps / 3 / per_epoch))
    return stage1, max(1, -(-(size.steps - stage1 * per_epoch) // per_epoch))


def ours_commands(size: PeerSize, out: Path, target: Path, extra: list[str] = (),
                  steps: int | None = None) -> list[tuple[str, list[str]]]:
    """Our train and export commands: the demo's recipe, then `extra` train flags (a lever under study, which
    may override any of them; the last value of a flag wins), for `steps` (default the size's, as theirs)."""
    cli = beagle_pipeline()
    size = PeerSize(**{**asdict(size), "steps": steps or size.steps})
    stage1, stage2 = stage_epochs(out / "store", size)
    return [
        ("ours-train", [*cli, "train", "--store", str(out / "store"), "--out", str(out / "ours"),
                        "--residual", "state", "--max-steps", str(size.steps), "--stage1-epochs", str(stage1),
                        "--stage2-epochs", str(stage2), "--batch-tokens", str(size.batch_tokens),
                        "--max-length", str(size.max_length), "--draft-vocab", str(size.draft_vocab),
                        "--lr", "1e-3", "--warmup-steps", "20", "--no-progress", *extra]),
        ("ours-export", [*cli, "export", str(out / "ours"), "--format", "eagle3", "--target", str(target),
                         "--out", str(out / "ours-eagle3"), "--force"]),
    ]


# What the CPU needs of speculators' CLI beyond its defaults, each a documented flag value: FlexAttention (its
# default) has no backward on the CPU, and its fused losses need Triton; a spawned dataloader worker per
# core would only compete with the trainer for 2 cores (ours reads in the training process too).
SPECULATORS_CPU_FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0"]


def theirs_epochs(out: Path, size: PeerSize) -> int:
    """Epochs that cover `size.steps` of speculators' batches. Its `--max-steps` ends an epoch, not the run
    (each later epoch still takes one step, at a learning rate its schedule has brought to 0, and validates),
    so the epochs are sized to end near `--max-steps` instead: its sampler packs the training share
    (`--train-data-ratio`, 0.9 by default) into batches of `--total-seq-len` tokens."""
    lengths = json.loads((out / "speculators-data" / "beagle_features.json").read_text(encoding="utf-8"))
    per_epoch = max(1, int(0.9 * lengths["tokens"] / size.batch_tokens))
    return max(1, -(-size.steps // per_epoch))


def theirs_command(size: PeerSize, out: Path, target: Path) -> tuple[str, list[str]]:
    layers = json.loads((out / "speculators-data" / "beagle_features.json").read_text(encoding="utf-8"))
    return ("theirs-train", [str(SPECULATORS_PYTHON), str(SPECULATORS_CPU),
                             "--verifier-name-or-path", str(target),
                             "--data-path", str(out / "speculators-data"), "--on-missing", "raise",
                             "--target-layer-ids", *map(str, layers["target_layer_ids"]),
                             "--save-path", str(out / "theirs"),
                             "--max-steps", str(size.steps), "--epochs", str(theirs_epochs(out, size)),
                             "--total-seq-len", str(size.batch_tokens),
                             "--draft-vocab-size", str(size.draft_vocab),
                             *SPECULATORS_CPU_FLAGS, "--no-resume-from-checkpoint"])


def theirs_steps(log: Path) -> int:
    """The optimizer steps speculators took, from its log (`global_step=N` is logged before each step's +1)."""
    import re

    steps = [int(n) for n in re.findall(r"global_step=(\d+)", log.read_text(encoding="utf-8", errors="replace"))]
    return max(steps) + 1 if steps else 0


def theirs_checkpoint(out: Path) -> Path:
    """The last checkpoint speculators saved: its highest-numbered epoch folder (config.json + model.safetensors,
    which vLLM loads as a speculators model)."""
    folders = [p for p in (out / "theirs").iterdir() if p.name.isdigit() and (p / "config.json").is_file()]
    if not folders:
        raise RuntimeError(f"speculators wrote no checkpoint under {out / 'theirs'}")
    return max(folders, key=lambda p: int(p.name))


def _can_keep_theirs(previous: dict, report: dict, out: Path) -> bool:
    """Whether an earlier run's speculators drafter answers the same question: same size (steps, tokens per
    step, data), target, prompts and dtype, its training recorded and its checkpoint still on disk."""
    as_json = json.loads(json.dumps(report))  # tuples as the lists a JSON file holds
    same = all(previous.get(key) == as_json[key] for key in ("size", "target", "prompts", "dtype"))
    same = same and recorded_target_dtype(previous) == report["target_dtype"]
    trained = "theirs-train" in previous.get("steps", {}) and (out / "logs" / "theirs-train.log").is_file()
    try:
        theirs_checkpoint(out)
    except (RuntimeError, FileNotFoundError):
        return False
    return same and trained


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the <= 15-minute size: k = 3 only, fewer prompts and steps")
    p.add_argument("--prompts", default=str(DEMO_QUESTIONS),
                   help="held-out prompts to serve (MT-Bench `turns`, `messages` or `prompt` JSONL)")
    p.add_argument("--target", default=str(DEMO_MODEL))
    p.add_argument("--sharegpt", default=str(DEMO_SHAREGPT), help="training prompts the target answers")
    p.add_argument("--out", default=None, help="run folder (default runs/peer[-quick])")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of both trainers (default: the size's)")
    p.add_argument("--train-prompts", type=int, default=None,
                   help="ShareGPT prompts the target answers for the training data of both (default: the size's); "
                        "the data-scaling comparison")
    p.add_argument("--regenerate-engine", choices=("hf", "vllm"), default="hf",
                   help="what runs the target for the training answers (vllm: 1.4x hf's generation rate on this "
                        "idle CPU, `make serve-venv`); both trainers read the same answers either way")
    p.add_argument("--target-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="the target's dtype in regenerate and extract, and so the store's (auto: bf16 where the "
                        "hardware multiplies it natively, else fp32)")
    p.add_argument("--serve-prompts", type=int, default=None)
    p.add_argument("--ks", default=None, help="num_speculative_tokens to serve, e.g. 1,2,3")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (float32: answers must equal plain decoding)")
    p.add_argument("--ours-flags", default="",
                   help="extra `beagle-pipeline train` flags for ours (a lever of docs/benchmarks.md), e.g. "
                        "\"--init-from-target .cache/demo/model\"; written into the results")
    p.add_argument("--ours-steps", type=int, default=None,
                   help="train ours for this many steps instead of the peer's (same tokens per step): the "
                        "equal-wall-time comparison; the results say so beside P15")
    p.add_argument("--keep-ours", action="store_true",
                   help="reuse our trained and exported drafter from an earlier run in --out when its train command "
                        "was exactly this one's")
    p.add_argument("--theirs-from", default=None,
                   help="an earlier run's results (peer.json) whose speculators training and vLLM runs stand in for "
                        "this run's, on the same data recipe, steps and prompts (checked); the results say so")
    p.add_argument("--keep-theirs", action="store_true",
                   help="reuse speculators' trained drafter and its vLLM runs from an earlier run in --out on the "
                        "same store and steps (its training takes most of the run); retrain ours only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_demo()
    for python, make in ((SPECULATORS_PYTHON, "make speculators-venv"), (VLLM_PYTHON, "make serve-venv")):
        if not python.is_file():
            raise SystemExit(f"{python} not found: run `{make}`")
    size = SIZES["quick" if args.quick else "full"]
    overrides = {"steps": args.steps, "serve_prompts": args.serve_prompts, "prompts": args.train_prompts,
                 "ks": tuple(int(k) for k in args.ks.split(",")) if args.ks else None}
    size = PeerSize(**{**asdict(size), **{k: v for k, v in overrides.items() if v is not None}})
    out = Path(args.out or ROOT / "runs" / f"peer{'-quick' if args.quick else ''}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    target, results_path = Path(args.target).resolve(), out / "peer.json"
    previous = json.loads(results_path.read_text(encoding="utf-8")) if results_path.is_file() else {}
    ours_flags = shlex.split(args.ours_flags)
    report: dict = {"size": asdict(size), "machine": machine(), "target": str(target), "prompts": args.prompts,
                    "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"), "steps": {}, "serve": {},
                    "ours_flags": ours_flags, "ours_steps": args.ours_steps or size.steps,
                    "regenerate_engine": args.regenerate_engine, "target_dtype": target_dtype(args.target_dtype)}

    if args.target_dtype == "auto" and report["target_dtype"] == "float32":
        print("note: this CPU multiplies bf16 only by emulation (no AMX or AVX512-BF16), so both trainers run in "
              "fp32; on a 2-core AMD EPYC speculators' trainer took ~250 s a step of 4,096 tokens (2026-12-07, "
              "docs/benchmarks.md), so even --quick takes hours there", flush=True)

    def save() -> None:
        results_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    def step(name: str, cmd: list[str], env: dict) -> dict:
        print(f"[{name}] {shlex.join(cmd)}", flush=True)
        report["steps"][name] = result = measured_run(cmd, out / "logs" / f"{name}.log", env=env)
        print(f"  {result['seconds']:.0f}s, peak {result['peak_rss_mib']:.0f} MiB "
              f"({result['peak_anon_mib']:.0f} MiB anonymous)", flush=True)
        save()
        return result

    for name, cmd in data_commands(size, out, target, Path(args.sharegpt), args.regenerate_engine,
                                   report["target_dtype"]):
        step(name, cmd, cli_env())
    recorded = json.loads(Path(args.theirs_from).read_text(encoding="utf-8")) if args.theirs_from else None
    if recorded is not None:
        as_json = json.loads(json.dumps(report))  # tuples as the lists a JSON file holds
        differs = [key for key in ("size", "prompts", "dtype") if recorded.get(key) != as_json[key]]
        differs += ["target_dtype"] if recorded_target_dtype(recorded) != report["target_dtype"] else []
        if differs:
            raise SystemExit(f"--theirs-from {args.theirs_from}: its {differs} differ from this run's")
    keep_theirs = recorded is None and args.keep_theirs and _can_keep_theirs(previous, report, out)
    if args.keep_theirs and not keep_theirs:
        print("--keep-theirs: no earlier speculators run on this store, size and prompts in "
              f"{results_path}; training it again", flush=True)
    ours = ours_commands(size, out, target, ours_flags, args.ours_steps)
    keep_ours = (args.keep_ours and previous.get("steps", {}).get("ours-train", {}).get("command") == shlex.join(ours[0][1])
                 and "ours-export" in previous.get("steps", {}) and (out / "ours-eagle3" / "config.json").is_file())
    if args.keep_ours and not keep_ours:
        print("--keep-ours: no earlier run of this exact train command in --out; training ours again", flush=True)
    kept = (*(() if keep_ours else (out / "ours",)), *(() if keep_theirs or recorded else (out / "theirs",)))
    for earlier in kept:  # this script's own earlier runs, retrained
        if earlier.is_dir():
            shutil.rmtree(earlier)
    for name, cmd in ours:
        if keep_ours:
            report["steps"][name] = previous["steps"][name]
            print(f"[{name}] kept from the run of {previous['date']}", flush=True)
        else:
            step(name, cmd, cli_env())
    if recorded is not None:
        report["steps"]["theirs-train"] = recorded["steps"]["theirs-train"]
        report["theirs_from"] = {"file": args.theirs_from, "date": recorded["date"],
                                 "theirs_steps_taken": recorded.get("theirs_steps_taken")}
        print(f"[theirs] its training and vLLM runs from {args.theirs_from} ({recorded['date']})", flush=True)
    elif keep_theirs:
        report["steps"]["theirs-train"] = previous["steps"]["theirs-train"]
        report["theirs_reused_from"] = previous["date"]
        print(f"[theirs-train] kept from the run of {previous['date']}", flush=True)
    else:
        step(*theirs_command(size, out, target), speculators_env())
    report["theirs_steps_taken"] = (recorded.get("theirs_steps_taken") if recorded is not None
                                    else theirs_steps(out / "logs" / "theirs-train.log"))
    report["speculators_cpu_changes"] = ("bench/speculators_cpu.py: device 'cpu' for the model and batches, CPU "
                                         "autocast, no accelerator synchronize; flags " +
                                         " ".join(SPECULATORS_CPU_FLAGS))
    drafters = {"ours": out / "ours-eagle3"}
    if recorded is None:
        drafters["theirs"] = theirs_checkpoint(out)
    report["drafters"] = {k: str(v) for k, v in drafters.items()}

    runs = out / "serve"
    runs.mkdir(exist_ok=True)
    served = {"prompts": args.prompts, "limit": size.serve_prompts, "dtype": args.dtype,
              "max_new_tokens": size.max_new_tokens, "target": target}

    def serve(name: str, **kwargs) -> dict:
        if keep_theirs and name.startswith("theirs-") and name in previous.get("serve", {}) and \
                (runs / f"{name}.json").is_file():
            print(f"[vllm {name}] kept from the run of {previous['date']}", flush=True)
            report["serve"][name] = previous["serve"][name]
            return {**json.loads((runs / f"{name}.json").read_text(encoding="utf-8")), **previous["serve"][name]}
        print(f"[vllm {name}]", flush=True)
        result = run_vllm(VLLM_PYTHON, runs / f"{name}.json", runs / f"{name}.log", **served, **kwargs)
        if "error" in result:
            raise RuntimeError(f"vLLM {name} failed ({result['error']}), log {result['log']}:\n{result['log_tail']}")
        report["serve"][name] = {k: v for k, v in result.items() if k != "answers"}
        save()
        return result

    plain = serve("plain")
    rows = {}
    for k in size.ks:
        row = {}
        for who, drafter in drafters.items():
            spec = serve(f"{who}-k{k}", drafter=drafter, method="eagle3", k=k)
            row[who] = {"acceptance_length": spec.get("acceptance_length"),
                        "per_position_acceptance": spec.get("per_position_acceptance"),
                        "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
                        **compare(plain, spec)}
        if recorded is not None:  # its speedup is over its own session's plain run
            row["theirs"] = {**recorded["by_k"][str(k)]["theirs"], "recorded": recorded["date"]}
        row["P15"] = row["ours"]["acceptance_length"] / row["theirs"]["acceptance_length"]
        rows[k] = row
        report["by_k"] = rows
        save()
    ours_train, theirs_train = report["steps"]["ours-train"], report["steps"]["theirs-train"]
    report["train_wall_ratio"] = ours_train["seconds"] / theirs_train["seconds"]
    report["train_peak_memory_ratio"] = ours_train["peak_rss_mib"] / theirs_train["peak_rss_mib"]
    if ours_train.get("peak_anon_mib") and theirs_train.get("peak_anon_mib"):  # runs before 2026-12-08 lack it
        report["train_peak_anon_memory_ratio"] = ours_train["peak_anon_mib"] / theirs_train["peak_anon_mib"]
    save()

    if report["ours_steps"] != size.steps or ours_flags:
        print(f"\nours: {report['ours_steps']} steps, extra flags {shlex.join(ours_flags) or '(none)'}; "
              f"speculators: {size.steps} steps", flush=True)
    print(f"\npeer run {size.name}: {size.steps} steps x {size.batch_tokens} tokens each, "
          f"{size.serve_prompts} prompts x {size.max_new_tokens} tokens served in vLLM ({args.dtype}, greedy)")
    print(f"training  ours {ours_train['seconds']:.0f}s / {ours_train['peak_rss_mib']:.0f} MiB, "
          f"speculators {theirs_train['seconds']:.0f}s / {theirs_train['peak_rss_mib']:.0f} MiB: "
          f"wall {report['train_wall_ratio']:.2f}x, memory {report['train_peak_memory_ratio']:.2f}x")
    if "train_peak_anon_memory_ratio" in report:
        print(f"          anonymous memory (the resident set less mapped files' pages): ours "
              f"{ours_train['peak_anon_mib']:.0f} MiB, speculators {theirs_train['peak_anon_mib']:.0f} MiB: "
              f"{report['train_peak_anon_memory_ratio']:.2f}x")
    print(f"{'k':>2}  {'ours τ':>7} {'speedup':>7} {'same':>6}   {'spec. τ':>7} {'speedup':>7} {'same':>6}   P15")
    for k, row in rows.items():
        o, t = row["ours"], row["theirs"]
        print(f"{k:>2}  {o['acceptance_length']:7.3f} {o['speedup']:6.2f}x {o['identical']:>3}/{o['total']:<2}  "
              f"{t['acceptance_length']:7.3f} {t['speedup']:6.2f}x {t['identical']:>3}/{t['total']:<2}  {row['P15']:.3f}")
    print(f"figures and commands written to {results_path}")
    last_k = 3 if 3 in rows else max(rows)
    print(f"P15 {rows[last_k]['P15']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

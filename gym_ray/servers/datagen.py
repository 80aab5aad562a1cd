"""The deterministic generator of the bundled ``data/arithmetic.jsonl`` (re-run it to rebuild the file).

``python -m gym_ray.servers.datagen`` rewrites the file; a test pins that the committed file equals
``arithmetic_rows()``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

#: Rows in the bundled dataset.
NUM_ROWS = 200


def arithmetic_rows(
    n: int = NUM_ROWS, *, seed: int = 20240611, agent: str = "arith_agent"
) -> list[dict[str, Any]]:
    """``n`` distinct arithmetic questions; harder operations and bigger operands get higher ``difficulty``.

    Each row: ``responses_create_params.input`` = one user message "What is A op B?", ``expected_answer``
    (a string), ``difficulty`` in [0.05, 0.6], ``agent_ref: {name: agent}``.
    """
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    asked: set[str] = set()
    while len(rows) < n:
        op = rng.choice("+-*")
        digits = (
            (rng.randint(1, 2), rng.randint(1, 2)) if op == "*" else (rng.randint(1, 3), rng.randint(1, 3))
        )
        a, b = (rng.randint(10 ** (d - 1) + 1, 10**d - 1) for d in digits)
        answer, base = {"+": (a + b, 0.05), "-": (a - b, 0.15), "*": (a * b, 0.45)}[op]
        size = (len(str(a)) + len(str(b)) - 2) / 4  # 0..1
        difficulty = round(min(0.6, base + 0.3 * size * rng.uniform(0.5, 1.0)), 2)
        question = f"What is {a} {op} {b}?"
        if question in asked:
            continue  # every task once: a repeated question would count as extra repeats of one task
        asked.add(question)
        rows.append(
            {
                "responses_create_params": {"input": [{"role": "user", "content": question}]},
                "expected_answer": str(answer),
                "difficulty": difficulty,
                "agent_ref": {"name": agent},
            }
        )
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` as JSONL (one compact object per line)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    write_jsonl(arithmetic_rows(), Path(__file__).resolve().parent / "data" / "arithmetic.jsonl")

"""Input rows: duplicate keys and non-finite numbers are refused with file and line (R9)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gym_ray.errors import InputError
from gym_ray.plan.load import load_jsonl

GOOD = '{"responses_create_params": {"input": "hi"}, "x": 1.5}\n'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param(
            '{"responses_create_params": {"input": "a", "input": "b"}}',
            "duplicate key 'input' in one JSON object (a JSON reader keeps only one of the values); remove "
            "or rename one of them, or set strict_json: false (+strict_json=false) to accept it as Python's "
            "json does",
            id="duplicate-nested-key",
        ),
        pytest.param(
            '{"responses_create_params": {"input": "a"}, "score": NaN}',
            "non-finite number NaN (not JSON: servers refuse it); write null or a finite number, or set "
            "strict_json: false (+strict_json=false) to accept it as Python's json does",
            id="nan",
        ),
        pytest.param(
            '{"responses_create_params": {"input": "a"}, "w": [1, -Infinity]}',
            "non-finite number -Infinity (not JSON: servers refuse it); write null or a finite number, or "
            "set strict_json: false (+strict_json=false) to accept it as Python's json does",
            id="minus-infinity",
        ),
        pytest.param(
            '{"responses_create_params": {"input": "a"}, "w": 1e400}',
            "number 1e400 overflows to infinity (not a finite JSON number); write a smaller number, or set "
            "strict_json: false (+strict_json=false) to accept it as Python's json does",
            id="overflow",
        ),
    ],
)
def test_non_json_numbers_and_duplicate_keys_are_refused_with_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(GOOD + GOOD + line + "\n" + GOOD)
    rows = load_jsonl(path)
    assert next(rows)["x"] == 1.5
    assert next(rows)["x"] == 1.5
    with pytest.raises(InputError) as caught:
        next(rows)
    assert str(caught.value) == f"{path}, line 3: {message}"
    assert (caught.value.path, caught.value.line) == (str(path), 3)


def test_strict_json_false_accepts_them_as_python_does(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"responses_create_params": {"input": "a", "input": "b"}, "s": NaN}\n')
    (row,) = load_jsonl(path, strict_json=False)
    assert row["responses_create_params"] == {"input": "b"}
    assert math.isnan(row["s"])

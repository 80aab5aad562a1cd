"""Input rows: duplicate keys and non-finite numbers are refused with file and line (R9); with
``strict_json=false`` a duplicate key is read as Python's json reads it, a non-finite number is still
refused (JSON cannot carry it to a server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_ray.errors import InputError
from gym_ray.plan.load import load_jsonl

GOOD = '{"responses_create_params": {"input": "hi"}, "x": 1.5}\n'
NON_FINITE = (
    "JSON cannot carry it, so no request body may hold it; write null, a finite number, or a string such "
    'as "NaN" if the server expects one'
)


_NON_FINITE_LINES = [
    ('{"responses_create_params": {"input": "a"}, "score": NaN}', "non-finite number NaN (not JSON)", "nan"),
    (
        '{"responses_create_params": {"input": "a"}, "w": [1, -Infinity]}',
        "non-finite number -Infinity (not JSON)",
        "minus-infinity",
    ),
    (
        '{"responses_create_params": {"input": "a"}, "w": 1e400}',
        "number 1e400 overflows a double to infinity (a JSON reader would read Infinity)",
        "overflow",
    ),
]


@pytest.mark.parametrize(
    ("line", "message", "strict"),
    [
        pytest.param(
            '{"responses_create_params": {"input": "a", "input": "b"}}',
            "duplicate key 'input' in one JSON object (a JSON reader keeps only one of the values); remove "
            "or rename one of them, or set strict_json: false (+strict_json=false) to accept it as Python's "
            "json does",
            True,
            id="duplicate-nested-key",
        ),
        *(
            pytest.param(line, f"{what}; {NON_FINITE}", strict, id=f"{name}-{strict=}")
            for line, what, name in _NON_FINITE_LINES
            for strict in (True, False)
        ),
    ],
)
def test_non_json_numbers_and_duplicate_keys_are_refused_with_file_and_line(
    tmp_path: Path, line: str, message: str, strict: bool
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(GOOD + GOOD + line + "\n" + GOOD)
    rows = load_jsonl(path, strict_json=strict)
    assert next(rows)["x"] == 1.5
    assert next(rows)["x"] == 1.5
    with pytest.raises(InputError) as caught:
        next(rows)
    assert str(caught.value) == f"{path}, line 3: {message}"
    assert (caught.value.path, caught.value.line) == (str(path), 3)


def test_strict_json_false_reads_a_duplicate_key_as_python_does(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"responses_create_params": {"input": "a", "input": "b"}, "s": 1.5}\n')
    (row,) = load_jsonl(path, strict_json=False)
    assert row == {"responses_create_params": {"input": "b"}, "s": 1.5}

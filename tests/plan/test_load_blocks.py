"""``load_jsonl`` reads whole lines a block at a time: rows, line numbers and errors do not depend on where
the blocks end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_ray.errors import InputError
from gym_ray.plan import load
from gym_ray.plan.load import load_jsonl

_LINES = [
    '{"responses_create_params":{"input":"q0"},"n":1}',
    '{"responses_create_params":{"input":"q1"},"big":123456789012345678901234567890}',  # an int past 64 bits
    '{"responses_create_params":{"input":"q2"},"k":{"\\u003a":1,"a":2}}',  # an escaped colon
    '{"responses_create_params":{"input":"q3 with é"}, "f": 1e20, "g": 1.5}',
    '{"responses_create_params":{"input":"q4"},"n":-9223372036854775809}\r',  # CRLF
    '{"responses_create_params":{"input":"q5"}}',
]


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("end", ["\n", ""], ids=["newline-at-end", "no-newline-at-end"])
def test_rows_are_what_json_reads_wherever_the_blocks_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int, end: str
) -> None:
    monkeypatch.setattr(load, "_BLOCK_BYTES", block)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(_LINES) + end).encode("utf-8"))
    rows = list(load_jsonl(path))
    assert rows == [json.loads(line) for line in _LINES]
    assert rows[1]["big"] == 123456789012345678901234567890
    assert rows[4]["n"] == -9223372036854775809
    assert json.dumps(rows) == json.dumps([json.loads(line) for line in _LINES])  # same types


@pytest.mark.parametrize("block", [3, 16, 1 << 20])
def test_a_line_too_long_is_named_by_its_line_after_the_rows_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(load, "_BLOCK_BYTES", block)
    path = tmp_path / "rows.jsonl"
    long_line = '{"responses_create_params":{"input":"' + "x" * 200 + '"}}'
    path.write_text("\n".join([_LINES[0], _LINES[5], long_line, _LINES[0]]) + "\n", encoding="utf-8")
    seen: list[object] = []
    rows = load_jsonl(path, max_line_bytes=100)
    with pytest.raises(InputError) as caught:
        seen.extend(rows)  # keeps the rows read before the error
    assert str(caught.value) == (
        f"{path}, line 3: line is longer than max_line_bytes=100; split the row or raise the limit"
    )
    assert caught.value.line == 3
    assert seen == [json.loads(_LINES[0]), json.loads(_LINES[5])]


@pytest.mark.parametrize("block", [5, 1 << 20])
def test_a_duplicate_key_and_a_blank_line_are_named_by_their_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(load, "_BLOCK_BYTES", block)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([*_LINES[:3], '{"responses_create_params":{},"a":1,"a":2}']) + "\n", "utf-8")
    with pytest.raises(InputError, match=r"rows.jsonl, line 4: duplicate key 'a' in one JSON object"):
        list(load_jsonl(path))
    assert list(load_jsonl(path, strict_json=False))[-1]["a"] == 2  # lenient: the last one wins
    path.write_text("\n".join([*_LINES[:2], "", _LINES[0]]) + "\n", "utf-8")
    with pytest.raises(InputError, match=r"rows.jsonl, line 3: blank line"):
        list(load_jsonl(path))

"""gym_ray.finalize.json_stream: the streamed reader agrees with json.loads, whatever the chunking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_ray.errors import ServerResponseError
from gym_ray.finalize.json_stream import StreamedList, iter_object

_HINT = "answer an object"
_TRICKY = st.sampled_from(['"', "\\", "[", "]", "{", "}", ",", ":", "\n", "é", "✓", "𝄞", " ", "1e5", "null"])
_TEXT = st.lists(st.one_of(_TRICKY, st.text(max_size=4)), max_size=6).map("".join)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    _TEXT,
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)
_OBJECTS = st.dictionaries(_TEXT, _VALUES, max_size=4)


def _read(
    path: Path, streamed_keys: tuple[str, ...], chunk: int
) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    got: dict[str, list[dict[str, Any]]] = {key: [] for key in streamed_keys}
    pairs = list(
        iter_object(
            path,
            streamed={key: got[key].append for key in streamed_keys},
            what="the body",
            hint=_HINT,
            chunk_bytes=chunk,
        )
    )
    return pairs, got


def _rebuild(pairs: list[tuple[str, Any]], got: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rebuilt: dict[str, Any] = {}
    for key, value in pairs:
        if isinstance(value, StreamedList):
            assert value.count == len(got[key])
            rebuilt[key] = got[key]
        else:
            rebuilt[key] = value
    return rebuilt


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    obj=_OBJECTS,
    rows=st.lists(st.dictionaries(_TEXT, _VALUES, max_size=3), max_size=5),
    chunk=st.one_of(st.integers(min_value=1, max_value=7), st.integers(min_value=8, max_value=300)),
    indent=st.sampled_from([None, 0, 2]),
    ensure_ascii=st.booleans(),
)
def test_reader_output_equals_json_loads(
    tmp_path: Path,
    obj: dict[str, Any],
    rows: list[dict[str, Any]],
    chunk: int,
    indent: int | None,
    ensure_ascii: bool,
) -> None:
    obj = {**obj, "rows": rows}
    path = tmp_path / "body.json"
    text = json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii)
    path.write_bytes(f" \n{text}\n ".encode())
    pairs, got = _read(path, ("rows",), chunk)
    assert [key for key, _ in pairs] == list(json.loads(text))
    assert _rebuild(pairs, got) == json.loads(text)
    assert dict(pairs)["rows"] == StreamedList(len(rows))


@pytest.mark.parametrize(
    "chunk", [pytest.param(1, id="1-byte"), pytest.param(3, id="3-bytes"), pytest.param(1 << 20, id="1-MiB")]
)
def test_numbers_cut_at_the_chunk_end_are_read_whole(tmp_path: Path, chunk: int) -> None:
    path = tmp_path / "b.json"
    path.write_text('{"a":12345.5e-3,"rows":[{"n":-0.25},{"n":10}],"b":[1.5,2e10],"c":NaN}')
    pairs, got = _read(path, ("rows",), chunk)
    assert pairs[:2] == [("a", 12.3455), ("rows", StreamedList(2))]
    assert pairs[2] == ("b", [1.5, 2e10])
    assert pairs[3][0] == "c"
    assert pairs[3][1] != pairs[3][1]  # NaN, as json.loads reads it
    assert got == {"rows": [{"n": -0.25}, {"n": 10}]}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("null", ("rows", None), id="null"),
        pytest.param('{"x": 1}', ("rows", {"x": 1}), id="object"),
        pytest.param(" [ ] ", ("rows", StreamedList(0)), id="empty-list"),
    ],
)
def test_a_streamed_key_that_holds_no_array_is_yielded_whole(
    tmp_path: Path, value: str, expected: tuple[str, Any]
) -> None:
    path = tmp_path / "b.json"
    path.write_text(f'{{"rows": {value}, "z": 0}}')
    pairs, got = _read(path, ("rows",), 2)
    assert pairs == [expected, ("z", 0)]
    assert got == {"rows": []}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param(
            "[1, 2]", "is not one JSON object: Expecting a JSON object '{' at character 0", id="array"
        ),
        pytest.param("", "is not one JSON object: it ends too early (truncated) at character 0", id="empty"),
        pytest.param(
            '{"a": [1, 2',
            "is not one JSON object: it ends too early (truncated) at character 11",
            id="truncated-in-value",
        ),
        pytest.param(
            '{"rows": [{"a": 1}, {"b"',
            "is not one JSON object: it ends too early (truncated) at character 24",
            id="truncated-in-element",
        ),
        pytest.param(
            '{"a": 1} x', "is not one JSON object: Extra data after the object at character 9", id="extra"
        ),
        pytest.param(
            '{"a": tru}', "is not one JSON object: Expecting value at character 6", id="bad-literal"
        ),
        pytest.param(
            '{"a" 1}', "is not one JSON object: Expecting ':' delimiter at character 5", id="no-colon"
        ),
        pytest.param(
            '{"rows": [{"a": 1}, 7, {}]}',
            "has rows[1] = a JSON number (7), not an object",
            id="non-object-element",
        ),
        pytest.param(
            '{"rows": [["x"]]}',
            'has rows[0] = a JSON array (["x"]), not an object',
            id="array-element",
        ),
    ],
)
def test_bad_bodies_are_server_response_errors_with_an_excerpt(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "b.json"
    path.write_text(text)
    for chunk in (1, 5, 1 << 20):
        with pytest.raises(ServerResponseError) as info:
            _read(path, ("rows",), chunk)
        assert str(info.value) == f"the body that {problem}; {_HINT}"
        assert info.value.body_excerpt == text


def test_invalid_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(
        ServerResponseError, match=r"^the body that is not UTF-8 \('utf-8' codec can't decode"
    ):
        _read(path, (), 3)


def test_the_excerpt_is_the_first_2000_bytes(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    text = '{"a": "' + "x" * 5000 + '", "rows": [1]}'
    path.write_text(text)
    with pytest.raises(ServerResponseError) as info:
        _read(path, ("rows",), 1000)
    assert info.value.body_excerpt == text[:2000]

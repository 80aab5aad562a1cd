"""``load_jsonl`` reads lines with orjson where that gives exactly what the json decoder gives: the rows,
and every error (duplicate keys, non-finite numbers, big integers, escapes, BOM), are the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_ray.errors import InputError
from gym_ray.plan import load
from gym_ray.plan.load import load_jsonl

_KEYS = st.sampled_from(["a", "b", "a:b", ":", "\\u003a", "null", "é", "k"])
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.sampled_from(["a", ":", '"', "\\", "\u00e9", "\U0001f600", "\n", " "]), max_size=6),
)


def _value(depth: int) -> st.SearchStrategy[str]:
    """JSON text, with objects that may repeat a key (json.dumps of each scalar; pairs joined by hand)."""
    scalar = _SCALARS.map(json.dumps)
    if depth == 0:
        return scalar
    inner = _value(depth - 1)
    pairs = st.lists(st.tuples(_KEYS, inner), max_size=4)
    obj = pairs.map(
        lambda ps: "{" + ",".join(f'"{k}":{v}' if k != "\\u003a" else f'"\\u003a":{v}' for k, v in ps) + "}"
    )
    arr = st.lists(inner, max_size=3).map(lambda vs: "[" + ", ".join(vs) + "]")
    return st.one_of(scalar, obj, arr)


def _read(path: Path, strict: bool) -> tuple[str, Any]:
    try:
        return "ok", list(load_jsonl(path, strict_json=strict))
    except InputError as exc:
        return "error", str(exc)


def _read_slow(path: Path, strict: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    with monkeypatch.context() as patch:
        patch.setattr(load, "_fast_decode", lambda content, strict_json: load._SLOW)
        patch.setattr(load, "_plain_decode", lambda content, strict_json: load._SLOW)
        return _read(path, strict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_value(3), strict=st.booleans(), bom=st.booleans())
def test_fast_and_json_reads_agree(
    body: str, strict: bool, bom: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = '{"responses_create_params":{"input":"q"},"v":' + body + "}"
    path = tmp_path / "rows.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + line.encode("utf-8", "surrogatepass") + b"\n")
    fast, slow = _read(path, strict), _read_slow(path, strict, monkeypatch)
    assert fast == slow
    if fast[0] == "ok":  # same types too: an int past 64 bits stays an int
        assert json.dumps(fast[1]) == json.dumps(slow[1])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param('{"responses_create_params":{"input":"q"},"n":123456789012345678901234567890}',
                     ("ok", 123456789012345678901234567890), id="int-past-64-bits-stays-an-int"),
        pytest.param('{"responses_create_params":{"input":"q"},"n":9223372036854775808}',
                     ("ok", 2**63), id="int-past-63-bits-stays-an-int"),
        pytest.param('{"responses_create_params":{"input":"q"},"n":-9223372036854775809}',
                     ("ok", -(2**63) - 1), id="negative-int-past-63-bits-stays-an-int"),
        pytest.param('{"responses_create_params":{"input":"q"},"n":{"a:":1,"a:":2}}',
                     ("error", "duplicate key 'a:'"), id="duplicate-key-holding-a-colon"),
        pytest.param('{"responses_create_params":{"input":"q"},"n":{"\\u003a":1,":":2}}',
                     ("error", "duplicate key ':'"), id="duplicate-key-written-as-an-escape"),
        pytest.param('{"responses_create_params":{"input":"q"},"n":{"a":"x:y","a":"z"}}',
                     ("error", "duplicate key 'a'"), id="duplicate-dropping-a-colon-string"),
    ],
)  # fmt: skip
def test_the_cases_the_fast_path_must_hand_over(line: str, expected: tuple[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    kind, value = _read(path, strict=True)
    assert kind == expected[0]
    if kind == "ok":
        assert value[0]["n"] == expected[1]
        assert type(value[0]["n"]) is int
    else:
        assert expected[1] in value

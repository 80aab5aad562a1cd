"""Every orjson fast path gives exactly what Python's ``json`` gives, on whichever orjson is installed.

A row's values are the user's data. Hypothesis writes JSON text the way people and other tools write it:
integers of any size (past 64 bits too), numbers in every exponent spelling (``1e5``, ``1E+05``,
``1e-7``, ``1.5e400``), ``-0`` and ``-0.0``, strings full of escapes (``\\u003a``, surrogate pairs, a
lone surrogate) and digits, nested objects that may repeat a key, and ``NaN`` / ``Infinity``. Each path is
held against ``json`` itself, with types compared too (an integer that became a float fails):

- reading input files (``load_jsonl``, strict and lenient, one line or many per block);
- reading any JSON text (``gym_ray._json.loads`` and ``orjson_loads``) and records (``parse_record``);
- writing values (``dumps_compact``, ``dumps_compact_lines``, the indented ``orjson_text``, ``encode_line``);
- planning a run: the materialized inputs, read back as a worker reads them to build each request body.

These tests failed on orjson 3.13 before the decode paths decided from the input bytes (a row holding
``123456789012345678901234567890`` was planned as ``1.2345678901234568e+29``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_ray._json import NOT_SURE, dumps_compact, dumps_compact_lines, loads, orjson_loads, orjson_text
from gym_ray.errors import InputError
from gym_ray.plan.load import load_jsonl
from gym_ray.plan.shards import prepare_run
from gym_ray.record.jsonl import JsonlReader, encode_line, parse_record
from tests.plan.test_common_rows import _config
from tests.test_json_equivalence import _same

_FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

# --- JSON text as people and tools write it ---------------------------------------------------------------

_DIGITS = "0123456789"
_EDGE_INTEGERS = [2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, 10**30 + 1]
_INTEGER_TEXT = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.sampled_from(_EDGE_INTEGERS).flatmap(lambda n: st.sampled_from([str(n), str(-n - 1), str(-n)])),
    st.just("-0"),
)
_FRACTION = st.one_of(st.just(""), st.text(_DIGITS, min_size=1, max_size=22).map(lambda d: "." + d))
_EXPONENT = st.one_of(
    st.just(""),
    st.tuples(
        st.sampled_from(["e", "E"]),
        st.sampled_from(["", "+", "-"]),
        st.one_of(st.integers(0, 400).map(str), st.text(_DIGITS, min_size=1, max_size=4)),
    ).map("".join),
)
_FLOAT_TEXT = st.one_of(
    st.tuples(
        st.sampled_from(["", "-"]),
        st.one_of(st.just("0"), st.integers(1, 10**25).map(str)),
        _FRACTION,
        _EXPONENT,
    )
    .filter(lambda parts: bool(parts[2] or parts[3]))
    .map("".join),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["-0.0", "0.0", "1e16", "1e-7", "1E+400", "-1e400", "1e-400", "5e-324", "0.00001"]),
)
_NON_FINITE_TEXT = st.sampled_from(["NaN", "Infinity", "-Infinity"])
_STRING_PIECES = [
    "a", "é", "😀", ":", " ", "\\u003a", "\\u003A", "\\u0041", '\\"', "\\\\", "\\/", "\\n", "\\t", "\\u0000",
    "\\ud83d\\ude00", "\\ud800", "\\u00e9", "1e5", "2E-3", "12345678901234567890", "0.0000", "null", "NaN",
]  # fmt: skip
_STRING_TEXT = st.lists(st.sampled_from(_STRING_PIECES), max_size=5).map(lambda p: '"' + "".join(p) + '"')
_KEY_TEXT = st.one_of(
    st.sampled_from(['"a"', '"b"', '"a:b"', '"\\u003a"', '":"', '"null"', '"1e5"']), _STRING_TEXT
)
_SPACE = st.sampled_from(["", " "])


def _value_text(depth: int) -> st.SearchStrategy[str]:
    scalar = st.one_of(
        _INTEGER_TEXT,
        _FLOAT_TEXT,
        _STRING_TEXT,
        st.sampled_from(["true", "false", "null"]),
        _NON_FINITE_TEXT,
    )
    if depth == 0:
        return scalar
    inner = _value_text(depth - 1)
    pairs = st.lists(st.tuples(_KEY_TEXT, _SPACE, inner), max_size=4)
    obj = pairs.map(lambda ps: "{" + ",".join(f"{k}:{s}{v}" for k, s, v in ps) + "}")
    arr = st.lists(st.tuples(_SPACE, inner), max_size=4).map(
        lambda vs: "[" + ",".join(s + v for s, v in vs) + "]"
    )
    return st.one_of(scalar, scalar, obj, arr)


_VALUE_TEXT = _value_text(3)


def _row_line(value: str) -> str:
    """An input line of the common shape (so planning takes its fast paths) holding ``value``."""
    return '{"responses_create_params":{"input":"q"},"agent_ref":{"name":"arith_agent"},"v":' + value + "}"


_ROW_LINES = st.lists(_VALUE_TEXT.map(_row_line), min_size=1, max_size=5)

# --- json, the reference ----------------------------------------------------------------------------------


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(text)
    return value


def _json_reads(line: str, strict: bool) -> tuple[bool, Any]:
    """``(True, value)`` as json reads an input line (non-finite numbers refused always, a repeated key
    when strict), else ``(False, None)``."""
    try:
        if strict:
            return True, json.loads(
                line, object_pairs_hook=_unique, parse_constant=_no_constant, parse_float=_finite
            )
        return True, json.loads(line, parse_constant=_no_constant, parse_float=_finite)
    except ValueError:
        return False, None


def _json_compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _outcome(call: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except (ValueError, TypeError, RecursionError) as exc:
        return "error", type(exc)


# --- the fast paths against json --------------------------------------------------------------------------


@settings(max_examples=400, deadline=None, suppress_health_check=_FIXTURES)
@given(lines=_ROW_LINES, strict=st.booleans())
def test_input_files_are_read_as_json_reads_them(lines: list[str], strict: bool, tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8") + b"\n")
    expected = [_json_reads(line, strict) for line in lines]
    first_bad = next((i for i, (ok, _) in enumerate(expected) if not ok), None)
    got: list[Any] = []
    if first_bad is None:
        got = list(load_jsonl(path, strict_json=strict))
    else:
        with pytest.raises(InputError) as caught:
            got.extend(load_jsonl(path, strict_json=strict))
        assert caught.value.line == first_bad + 1
    assert len(got) == (len(lines) if first_bad is None else first_bad)
    for row, (_, value) in zip(got, expected, strict=False):
        assert _same(row, value), (row, value)


@settings(max_examples=400, deadline=None)
@given(text=_VALUE_TEXT)
def test_any_json_text_is_read_as_json_reads_it(text: str) -> None:
    raw = text.encode("utf-8")
    kind, want = _outcome(json.loads, text)
    got_kind, got = _outcome(loads, raw)
    assert got_kind == kind
    if kind == "ok":
        assert _same(got, want), (got, want)
    quick = orjson_loads(raw)
    assert quick is NOT_SURE or (kind == "ok" and _same(quick, want)), (quick, want)
    line = _row_line(text)
    record = parse_record(line.encode("utf-8"))
    kind, want = _outcome(json.loads, line)
    assert (record is None) == (kind != "ok")
    if record is not None:
        assert _same(record, want)


@settings(max_examples=400, deadline=None)
@given(texts=st.lists(_VALUE_TEXT, min_size=1, max_size=4))
def test_values_are_written_as_json_writes_them(texts: list[str]) -> None:
    values = [json.loads(text) for text in texts]  # NaN, infinities, lone surrogates, big integers included
    wanted = [_outcome(_json_compact, value) for value in values]
    for value, want in zip(values, wanted, strict=True):
        assert _outcome(dumps_compact, value) == want
        indented = orjson_text(value, orjson.OPT_INDENT_2)
        if indented is not None:
            assert indented == json.dumps(value, indent=2, ensure_ascii=False).encode("utf-8")
        compact = orjson_text(value)
        assert compact is None or compact == want[1]
        if isinstance(value, dict):
            assert _outcome(encode_line, value) == (("ok", want[1] + b"\n") if want[0] == "ok" else want)
    if all(kind == "ok" for kind, _ in wanted):
        assert dumps_compact_lines(values) == b"".join(text + b"\n" for _, text in wanted)


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURES)
@given(lines=_ROW_LINES, shard_size=st.sampled_from([1, 3, 100]))
def test_planned_inputs_hold_the_values_json_reads_and_a_worker_reads_them_back(
    lines: list[str], shard_size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the lines json reads and can write as UTF-8 (a lone surrogate cannot be: planning refuses that row)
    read = [(line, _json_reads(line, strict=True)) for line in lines]
    good = [line for line, (ok, value) in read if ok and _outcome(_json_compact, value)[0] == "ok"]
    rows = [json.loads(line) for line in good]
    if not rows:
        return
    # each row also as json's own compact text: the lines planning stamps without parsing them again
    good += [_json_compact(row).decode("utf-8") for row in rows]
    rows += rows
    base = tmp_path_factory.mktemp("plan")
    path = base / "rows.jsonl"
    path.write_bytes("\n".join(good).encode("utf-8") + b"\n")
    plan = prepare_run(_config(base, "run", path, shard_size=shard_size))
    planned: list[dict[str, Any]] = []
    for spec in plan.shards:
        inputs = base / "run" / f"rollouts-{spec.shard}_materialized_inputs.jsonl"
        for raw in inputs.read_bytes().splitlines():
            json.loads(raw, parse_constant=_no_constant)  # strict JSON, nothing a server refuses
        planned.extend(record for _, record in JsonlReader(inputs, strict=True))
    assert len(planned) == len(rows)
    planned.sort(key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]))
    by_task: dict[int, Any] = {}
    for record in planned:
        user = {k: v for k, v in record.items() if not k.startswith("_ng_")}
        assert _same(user, by_task.setdefault(record["_ng_task_index"], user))
    # every row's values reach the planned inputs: the same values, the same types
    for row in rows:
        assert any(_same(row, seen) for seen in by_task.values()), row
    body = json.dumps(planned[0], separators=(",", ":"), allow_nan=False)  # what the client sends
    assert _same(json.loads(body), planned[0])

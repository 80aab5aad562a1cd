"""gym_ray._json: orjson's bytes and values are used only where they are exactly the stdlib json module's."""

from __future__ import annotations

import datetime
import enum
import json
import math
import random
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gym_ray._json import NOT_SURE, dumps_compact, dumps_compact_lines, loads, orjson_loads, orjson_text


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


@dataclass
class Point:
    x: int


AWKWARD: list[Any] = [
    {"a": 1e16, "b": 1e15, "c": 1e-5, "d": 1e-4, "e": 0.1, "f": -0.0, "g": 123456789.123456789},
    {"big": 2**63, "bigger": 2**64, "huge": 2**70, "neg": -(2**63) - 1, "max": 2**63 - 1},
    {"nan": math.nan},
    {"inf": -math.inf},
    {"none": None},
    {1: "int key"},
    {None: 1},
    {1.5: "float key"},
    {"ctl": '\x00\x08\t\n\x0c\r\x1f\x7f\u2028\u2029"\\/', "uni": "éß漢字😀", "sur": "\ud800"},
    {"tuple": (1, 2), "nested": {"l": [[], {}, [{}]]}, "bool": [True, False]},
    {"enum": Colour.RED, "sub": Name("x"), Name("k"): 1},
    {"e-in-text": "1e5 and 2E-3", "digits": "12345678901234567890"},
    [1.0, 2.5, 1e300, 5e-324, 1.7976931348623157e308, 1234567890123456.7, 0.000123],
]
UNSERIALIZABLE: list[Any] = [{"dt": datetime.datetime(2024, 1, 1)}, {"p": Point(1)}, {"s": {1, 2}}]


def _json_compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _random_float(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.3:
        return rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)
    if kind < 0.6:
        return float(rng.randint(-(10**17), 10**17)) / 10 ** rng.randint(0, 20)
    return struct_float(rng)


def struct_float(rng: random.Random) -> float:
    """A float from random bits (every exponent and mantissa), finite."""
    while True:
        value = float.fromhex(f"{rng.choice('+-')}0x1.{rng.getrandbits(52):013x}p{rng.randint(-1074, 1023)}")
        if math.isfinite(value):
            return value


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return _random_float(rng)
    if kind == 1:
        return rng.choice([rng.randint(-1000, 1000), rng.randint(-(2**66), 2**66), 2**63 - rng.randint(0, 2)])
    if kind == 2:
        alphabet = 'ab "\\/\x00\x1f\x7fé漢😀e1E-+.0123456789\u2028'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.choice([math.nan, math.inf, 1e16, 1e-5, 0.0001, 100000000000000000.0])
    if kind in (5, 6):
        return {
            f"k{index}{rng.choice('eé')}": _random_value(rng, depth + 1) for index in range(rng.randrange(5))
        }
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (-0.0 is not 0.0, NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("value", [pytest.param(v, id=f"awkward-{i}") for i, v in enumerate(AWKWARD)])
def test_awkward_values_encode_exactly_as_json_or_raise_as_json(value: Any) -> None:
    try:
        expected: bytes | type[Exception] = _json_compact(value)
    except (TypeError, ValueError) as exc:
        expected = type(exc)
    if isinstance(expected, bytes):
        assert dumps_compact(value) == expected
    else:
        with pytest.raises(expected):
            dumps_compact(value)


@pytest.mark.parametrize(
    "value", [pytest.param(v, id=f"unserializable-{i}") for i, v in enumerate(UNSERIALIZABLE)]
)
def test_what_json_cannot_encode_is_refused_with_json_s_type_error(value: Any) -> None:
    with pytest.raises(TypeError):
        json.dumps(value)
    with pytest.raises(TypeError):
        dumps_compact(value)


def test_random_values_encode_exactly_as_json_compact_and_indented() -> None:
    rng = random.Random(20261201)
    fast = 0
    for _ in range(6000):
        value = {"v": _random_value(rng)}
        assert dumps_compact(value) == _json_compact(value), value
        indented = orjson_text(value, orjson.OPT_INDENT_2)
        if indented is not None:
            assert indented == json.dumps(value, indent=2, ensure_ascii=False).encode("utf-8"), value
        fast += orjson_text(value) is not None
    # the fast path is taken for most values (the rest have exponents, nulls or long numbers)
    assert fast > 1500


def test_random_floats_of_every_magnitude_encode_exactly_as_json() -> None:
    rng = random.Random(7)
    for _ in range(20000):
        value = [struct_float(rng), _random_float(rng)]
        assert dumps_compact(value) == _json_compact(value), value


def _mutated(rng: random.Random, text: bytes) -> bytes:
    line = bytearray(text)
    for _ in range(rng.randrange(0, 3)):
        position = rng.randrange(len(line) + 1)
        choice = rng.random()
        if choice < 0.4 and position < len(line):
            line[position] = rng.choice(b'{}[]":,0123456789.eE+-tfnulNaI\\ \t\x00\x7f\xc3\xa9\xed\xff')
        elif choice < 0.7 and position < len(line):
            del line[position]
        else:
            line.insert(position, rng.choice(b'0123456789e-"\\,'))
    return bytes(line)


def test_orjson_reads_only_what_json_reads_and_reads_it_the_same() -> None:
    rng = random.Random(11)
    fast = 0
    texts = [b'{"a":1,"a":2}', b'{"x":18446744073709551616}', b'{"x":-9223372036854775809}', b"[1e400]"]
    texts += [b'{"n":NaN}', b'"\\ud800"', b"\xef\xbb\xbf{}", b"{} ", b" [1] ", b"-0", b"1.0", b"{}x"]
    for _ in range(8000):
        texts.append(_mutated(rng, _json_compact({"v": _random_value(rng)})))
    for raw in texts:
        got = orjson_loads(raw)
        if got is NOT_SURE:
            continue
        fast += 1
        expected = json.loads(raw.decode("utf-8"))  # must not raise: orjson accepted it
        assert _same(got, expected), raw
    assert fast > 2000


def test_loads_gives_json_loads_value_or_error_for_every_text() -> None:
    """What the /run client reads a reply with: json.loads' value (types included) or a ValueError."""
    rng = random.Random(3)
    texts = [
        b'{"x":18446744073709551616}',
        b'{"n":NaN}',
        b"[1e400]",
        '{"u":"é"}'.encode("utf-16"),
        b"{}x",
        b"",
    ]
    texts += [_mutated(rng, _json_compact({"v": _random_value(rng)})) for _ in range(3000)]
    for raw in texts:
        try:
            expected: Any = json.loads(raw)
        except ValueError as exc:
            expected = exc
        if isinstance(expected, ValueError):
            with pytest.raises(type(expected)) as raised:
                loads(raw)
            assert str(raised.value) == str(expected)  # json's own message
        else:
            assert _same(loads(raw), expected), raw
    assert loads(b'{"x":18446744073709551616}') == {"x": 18446744073709551616}  # exact, not a float


@pytest.mark.parametrize(
    "value",
    [
        {"error": None, "reward": math.nan},
        [None, math.inf],
        {"a": {"b": [None, {"c": -math.inf}]}},
        [math.nan],
    ],
)
def test_a_non_finite_float_next_to_a_null_is_written_as_json_writes_it(value: Any) -> None:
    # orjson writes NaN and infinities as null: such a value must take json's path (NaN / Infinity).
    assert orjson_text(value) is None
    assert dumps_compact(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    assert b"null" in orjson.dumps(value)  # the case the guard is for: orjson's text holds a null


def test_a_record_whose_nulls_are_all_none_keeps_orjson_s_bytes() -> None:
    record = {"response": {"error": None, "incomplete_details": None, "output": [{"text": "7"}]}, "r": 1.5}
    expected = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    assert orjson_text(record) == expected  # the fast path, not None: nulls that are None are safe
    assert orjson_text((None, 1)) is None  # a tuple reads back as a list: not equal, so json decides
    assert dumps_compact((None, 1)) == b"[null,1]"


def test_a_record_with_hex_ids_and_number_like_text_keeps_orjson_s_bytes() -> None:
    # Response ids are hex ("6e6a" looks like an exponent once digits are masked) and texts hold numbers:
    # only numbers themselves decide, so such a record stays on orjson (it went to json before).
    record = {
        "response": {"id": "resp_b3737001566e6a4c16f5a5ca", "created_at": 1796195114.0, "error": None},
        "text": "What is 0 + 3? 1e5, 12.34567 and 123456789012345678",
        "reward": 1.0,
    }
    expected = _json_compact(record)
    assert orjson_text(record) == expected
    assert dumps_compact_lines([record, record]) == expected + b"\n" + expected + b"\n"
    for unsure in (1e-05, 1e16, 0.12345, 12345678901234567, -1.5e300):
        with_number = {**record, "reward": unsure}
        assert orjson_text(with_number) is None, unsure  # a number of its own: json writes it
        assert dumps_compact(with_number) == _json_compact(with_number)


def test_random_records_of_number_like_strings_and_floats_encode_exactly_as_json() -> None:
    # Strings made of the characters around numbers (":1e5", ",0.00001", "[12345678901234567") next to
    # floats of every magnitude: one record, one block of lines, and the indented form are json's bytes.
    rng = random.Random(20261202)
    alphabet = "0123456789eE.-+:,[ \nab"
    fast = 0
    for _ in range(4000):
        record: dict[str, Any] = {
            "s": "".join(rng.choice(alphabet) for _ in range(rng.randrange(20))),
            "x": rng.choice([_random_float(rng), rng.randint(-(10**18), 10**18), 1.5, 7]),
            "l": [rng.choice([_random_float(rng), "".join(rng.choice(alphabet) for _ in range(6))])],
        }
        expected = _json_compact(record)
        assert dumps_compact(record) == expected, record
        assert dumps_compact_lines([record, {"k": 1}]) == expected + b'\n{"k":1}\n', record
        indented = orjson_text(record, orjson.OPT_INDENT_2)
        if indented is not None:
            assert indented == json.dumps(record, indent=2, ensure_ascii=False).encode("utf-8"), record
        fast += orjson_text(record) is not None
    assert fast > 400  # records whose numbers are plain take the fast path whatever their strings hold

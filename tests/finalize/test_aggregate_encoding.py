"""The metrics file's values are written as NeMo Gym 0.7 writes them: ``orjson.dumps(v, OPT_INDENT_2)``.

``_aggregate_fragments.indented`` is orjson's text, and ``json``'s (indent 2) only where orjson cannot
encode (an integer beyond 64 bits, on which 0.7's writer fails); the oracle here is orjson itself, over
values chosen where the ``json`` module writes otherwise (exponents, 17+ digit numbers) and where the two
agree, and NaN and infinity are refused (orjson would write them as null).
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from gym_ray.finalize._aggregate_fragments import indented as _indented
from gym_ray.finalize.aggregate import _atomic_write_json, read_metrics_summary

_AWKWARD: list[Any] = [
    1e-05,
    -2.5e-05,
    0.0001,
    0.00012,
    1e-7,
    1e16,
    9999999999999998.0,
    1e15 + 0.5,
    1e21,
    123456789012345678,
    2**63 - 1,
    -(2**63),
    2**64,
    2**70,
    -0.0,
    0.0,
    1 / 3,
    100.0,
    True,
    None,
    'tâche ✓ \x00\x1f\x7f\u2028 "q" \\',
    "1e5 in a string",
    [],
    {},
    [1, 2.5, "x", None, False, {"nested": [1e-9, {}]}],
]


def _oracle(element: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(element, option=orjson.OPT_INDENT_2)  # 0.7's metrics file writer
    except orjson.JSONEncodeError:  # beyond 64 bits: 0.7 fails; gym_ray writes json's text
        return json.dumps(element, indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8")


@pytest.mark.parametrize("value", _AWKWARD, ids=repr)
def test_element_bytes_equal_0_7s_encoder(value: Any) -> None:
    element = {"task_index": 3, "value": value, "mean/reward": 0.5}
    assert _indented(element) == _oracle(element)


def test_random_floats_of_every_magnitude_equal_0_7s_encoder() -> None:
    rng = random.Random(17)
    checked = 0
    while checked < 20_000:
        if checked % 2:
            value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        else:
            value = rng.uniform(-1, 1) * 10 ** rng.uniform(-9, 22)
        if math.isnan(value) or math.isinf(value):
            continue
        element = {"v": value, "n": [value, {"w": -value}]}
        assert _indented(element) == _oracle(element), repr(value)
        checked += 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "Out of range float values are not JSON compliant"),
        (math.inf, "Out of range float values are not JSON compliant"),
        (-math.inf, "Out of range float values are not JSON compliant"),
        ("\ud800", "surrogates not allowed"),
    ],
    ids=repr,
)
def test_values_json_refuses_are_refused(value: Any, message: str) -> None:
    # orjson would write NaN/infinity as null; the metrics file refuses them, as json's allow_nan=False does.
    with pytest.raises(ValueError, match=message):
        _indented({"v": value})


def test_summary_of_the_file_just_written_equals_the_file_read_back(tmp_path: Path) -> None:
    entries: list[dict[str, Any]] = [
        {
            "agent_ref": {"name": "a"},
            "_ng_environment_server": "env_a",
            "agent_metrics": {"mean/reward": 1 / 3, "tiny": 1e-05, "big": 2**70},
            "key_metrics": {"mean/reward": 1 / 3},
            "group_level_metrics": [{"task": 0}],
            "repeat_level_metrics": [],
        },
        {"agent_ref": {"name": "env_b"}, "_ng_environment_server": "env_b", "aggregation_error": "E: x"},
    ]
    path = tmp_path / "m.json"
    _atomic_write_json(path, entries, threading.Event())
    expected = [{k: v for k, v in e.items() if not k.endswith("level_metrics")} for e in entries]
    assert read_metrics_summary(path) == expected
    # Another process replaces the file: the summary is the new file's, not the one written here.
    other = [{"agent_ref": {"name": "c"}, "_ng_environment_server": "env_c", "key_metrics": {"m": 2}}]
    path.with_name("new.json").write_text(json.dumps(other, indent=2))
    os.replace(path.with_name("new.json"), path)
    assert read_metrics_summary(path) == other

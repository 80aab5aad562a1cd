"""The per-task metrics elements are written as ``json.dumps(indent=2)`` writes them, whichever encoder runs.

``_aggregate_fragments.indented`` uses orjson where its text provably equals the ``json`` module's and falls
back to ``json`` otherwise; the oracle here is the ``json`` module itself, over values chosen where the
two encoders differ (exponents, 17+ digit numbers, integers beyond 64 bits, NaN) and where they agree.
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

import pytest

from gym_ray.record._aggregate_fragments import indented as _indented
from gym_ray.record.aggregate import _atomic_write_json, read_metrics_summary

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
    return json.dumps(element, indent=2, ensure_ascii=False, allow_nan=False).encode("utf-8")


@pytest.mark.parametrize("value", _AWKWARD, ids=repr)
def test_element_bytes_equal_the_json_module(value: Any) -> None:
    element = {"task_index": 3, "value": value, "mean/reward": 0.5}
    assert _indented(element) == _oracle(element)


def test_random_floats_of_every_magnitude_equal_the_json_module() -> None:
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
    # orjson would write NaN/infinity as null; the metrics file must refuse them, as json does.
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

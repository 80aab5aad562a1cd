"""Runs of a streamed list read at once by orjson, against the element-by-element path they replace.

Oracles: ``json.loads`` of the whole file (the values), and the reader with runs switched off (the
element-by-element ``json`` path before runs existed) for every error message. The fragment writer's
run encoding is checked against its own element-by-element encoding (itself checked against ``json``
in ``test_aggregate_encoding.py``).
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from gym_ray.errors import ServerResponseError
from gym_ray.finalize import json_stream
from gym_ray.finalize._aggregate_fragments import FragmentWriter
from gym_ray.finalize.json_stream import StreamedList, iter_object
from tests.test_json_equivalence import _random_float, _random_value, _same, struct_float


def _element(rng: random.Random, index: int) -> dict[str, Any]:
    """Elements that share their first key; some hold lists of objects that start with it too."""
    element: dict[str, Any] = {"_ng_task_index": index, "reward": _random_float(rng)}
    kind = 1 if index % 50 == 7 else rng.choice([0, 2, 3])
    if kind == 0:
        element["rollout_infos"] = [{"_ng_task_index": index, "r": struct_float(rng)} for _ in range(3)]
    elif kind == 1:
        element["payload"] = _random_value(rng)  # NaN, infinities, big integers, unicode, nesting
    elif kind == 2:
        element["sample"] = {"agent_ref": {"name": "é漢😀\u2028"}, "none": None, "empty": [{}, []]}
    return element


def _file(tmp_path: Path, elements: list[Any], *, indent: int | None, ascii_only: bool) -> Path:
    path = tmp_path / "reply.json"
    body = {"agent_metrics": {"x": 1}, "rows": elements, "key_metrics": {"y": 2.5}}
    path.write_text(json.dumps(body, indent=indent, ensure_ascii=ascii_only), encoding="utf-8")
    return path


class _Collect:
    def __init__(self, with_runs: bool) -> None:
        self.values: list[dict[str, Any]] = []
        self.runs = 0
        if with_runs:
            self.on_run = self._on_run

    def __call__(self, value: dict[str, Any]) -> None:
        self.values.append(value)

    def _on_run(self, run: list[dict[str, Any]]) -> None:
        self.runs += 1
        self.values.extend(run)


def _read(path: Path, chunk: int, callback: Any) -> list[tuple[str, Any]]:
    return list(
        iter_object(path, streamed={"rows": callback}, what="the body", hint="fix it", chunk_bytes=chunk)
    )


@pytest.mark.parametrize("chunk", [97, 4096, 1 << 18])
@pytest.mark.parametrize(("indent", "ascii_only"), [(None, False), (2, True), (None, True)])
def test_every_element_is_handed_over_as_json_loads_reads_it(
    tmp_path: Path, chunk: int, indent: int | None, ascii_only: bool
) -> None:
    rng = random.Random(chunk + (indent or 0))
    elements = [_element(rng, index) for index in range(400)]
    path = _file(tmp_path, elements, indent=indent, ascii_only=ascii_only)
    expected = json.loads(path.read_text(encoding="utf-8"))
    for with_runs in (True, False):
        collect = _Collect(with_runs)
        pairs = _read(path, chunk, collect)
        assert [key for key, _ in pairs] == ["agent_metrics", "rows", "key_metrics"]
        assert pairs[1] == ("rows", StreamedList(400))
        assert _same(collect.values, expected["rows"])
        if with_runs and chunk > 1000:
            assert collect.runs > 0  # the fast path was taken


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("[1, 2]", id="not-an-object"),
        pytest.param('{"_ng_task_index": 1,}', id="trailing-comma"),
        pytest.param('{"_ng_task_index": NaN, "x": 1e999}', id="nan-is-read-by-json"),
        pytest.param('{"_ng_task_index": 1} {"x": 2}', id="missing-comma"),
    ],
)
def test_a_bad_element_after_runs_raises_what_the_element_by_element_path_raises(
    tmp_path: Path, bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = ", ".join(json.dumps({"_ng_task_index": index, "v": [index, {"w": "x"}]}) for index in range(300))
    path = tmp_path / "reply.json"
    path.write_text('{"rows": [' + good + ", " + bad + ", " + good + "]}", encoding="utf-8")

    def outcome() -> tuple[str, list[dict[str, Any]]]:
        collect = _Collect(with_runs=True)
        try:
            _read(path, 4096, collect)
        except ServerResponseError as exc:
            return str(exc), collect.values
        return "no error", collect.values

    got = outcome()
    monkeypatch.setattr(json_stream._Runs, "take", lambda self, reader: None)
    assert got[0] == outcome()[0]
    assert _same(got[1], outcome()[1])
    if "NaN" not in bad:
        assert got[0].startswith("the body that ")


def _fragment(tmp_path: Path, name: str, elements: list[dict[str, Any]], runs: list[int]) -> bytes:
    writer = FragmentWriter("rows", tmp_path / name, threading.Event(), "w", "h")
    position = 0
    for size in runs:
        part = elements[position : position + size]
        if size == 1:
            writer(part[0])
        else:
            writer.on_run(part)
        position += size
    assert writer.handle is not None
    writer.handle.close()
    assert writer.count == len(elements)
    return (tmp_path / name).read_bytes()


def test_a_run_is_written_as_its_elements_one_by_one(tmp_path: Path) -> None:
    rng = random.Random(21)
    elements = []
    for index in range(600):
        element = _element(rng, index)
        text = orjson.dumps(element) if index % 7 else b'{"_ng_task_index": %d, "f": 1e-7}' % index
        try:
            elements.append(orjson.loads(json.dumps(json.loads(text), allow_nan=False)))
        except ValueError:  # NaN, big integers: never in a run (orjson does not read them)
            continue
    elements.insert(3, {})
    elements.insert(5, {"n": None, "u": "é\u2028", "l": [], "o": {}, "deep": [[{"a": [1.5, -0.0]}]]})
    one_by_one = _fragment(tmp_path, "slow.part", elements, [1] * len(elements))
    sizes, left = [], len(elements)
    while left:
        sizes.append(min(left, rng.choice([1, 2, 5, 40, 200])))
        left -= sizes[-1]
    assert _fragment(tmp_path, "runs.part", elements, sizes) == one_by_one
    assert _fragment(tmp_path, "one-run.part", elements, [len(elements)]) == one_by_one

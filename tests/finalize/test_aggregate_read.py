"""The one-pass read of the merged file for aggregation against the slow path it replaces.

The oracle is the path before: ``JsonlReader(strict=True)`` records through ``group_results`` (bodies
encoded by the stdlib ``json`` module). The fast path must read the same records, raise the same error,
and send bodies that hold the same JSON values in the same order (compared after ``json.loads``, types
included: ``1`` is not ``1.0``, ``-0.0`` is not ``0.0``).
"""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import InputError
from gym_ray.finalize._aggregate_read import compact_plain, group_merged, iter_merged
from gym_ray.finalize._aggregate_spool import ServerSpools, group_results, strip_for_aggregation
from gym_ray.finalize.aggregate import aggregate_metrics, aggregate_run
from gym_ray.record.jsonl import JsonlReader
from tests.finalize.test_aggregate import _HOST, _agent, _base_config, _Recorder, _ref
from tests.test_json_equivalence import _random_float, _random_value, _same, struct_float

# Lines orjson cannot vouch for (json reads them: NaN, infinity, an integer past 64 bits, a lone
# surrogate escape, 19 digits in a row) and lines it reads (floats of every form, unicode, nesting).
_AWKWARD_LINES = [
    b'{"reward":NaN,"x":-Infinity}',
    b'{"big":18446744073709551616,"neg":-9223372036854775809,"i64":9223372036854775807}',
    b'{"sur":"\\ud800 alone","pair":"\\ud83d\\ude00"}',
    b'{"id":"1234567890123456789012"}',
    '{"uni":"éß漢字😀\\u2028","esc":"\\u00e9\\n\\t\\"\\\\/"}'.encode(),
    b'{"f":[1e16,1E-5,0.0001,1e300,5e-324,-0.0,1.7976931348623157e308,2.5e-7,100000000000000000.0]}',
    b'{"i":[999999999999999999,-999999999999999999,0,-1],"n":null,"t":true,"nest":{"a":[{"b":{}}]}}',
    b'{"dup":1,"other":2,"dup":3}',
    b'  {"padded": true}  ',
]


def _records(rng: random.Random, count: int) -> list[bytes]:
    """Merged-file lines: stamped records with random values, in json's every spelling."""
    lines = []
    for index in range(count):
        record: dict[str, Any] = {
            "reward": _random_float(rng) if index % 3 else struct_float(rng),
            "payload": _random_value(rng),
            "response": {"usage": {"total_tokens": index, "ratio": _random_float(rng)}, "output": ["heavy"]},
            "responses_create_params": {"input": "heavy"},
            "_ng_task_index": rng.randrange(8),
            "_ng_rollout_index": rng.randrange(3),
            "_ng_environment_server": rng.choice(["env_a", "env_b"]),
            "agent_ref": {"name": "ag1"},
        }
        ascii_only = rng.random() < 0.5
        lines.append(json.dumps(record, separators=(",", ":"), ensure_ascii=ascii_only).encode())
    return lines


def _write(path: Path, lines: list[bytes], *, final_newline: bool = True) -> None:
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))


def test_every_record_reads_as_the_strict_reader_reads_it(tmp_path: Path) -> None:
    merged = tmp_path / "rollouts.jsonl"
    lines = _records(random.Random(5), 400) + _AWKWARD_LINES
    _write(merged, [*lines[:10], b"", b"   ", *lines[10:]], final_newline=False)  # blanks; no final \n
    expected = [record for _, record in JsonlReader(merged, strict=True, missing_ok=False)]
    got = list(iter_merged(merged))
    assert len(got) == len(expected) == len(lines)
    for (record, _), want in zip(got, expected, strict=True):
        assert _same(record, want)
    plain = [is_plain for _, is_plain in got]
    assert plain[-len(_AWKWARD_LINES) :] == [False, False, False, False, True, True, True, True, True]
    assert 200 < sum(plain) < 400  # the random records: most are read by orjson (some hold NaN, big ints)


@pytest.mark.parametrize(
    "bad",
    [b'{"a":1', b"[1,2]", b'"text"', b"\xff\xfe{}", b'{"n":NaN', b'{"big":1234567890123456789012', b"{}x"],
)
def test_a_line_that_is_not_an_object_raises_the_strict_reader_s_error(tmp_path: Path, bad: bytes) -> None:
    merged = tmp_path / "rollouts.jsonl"
    _write(merged, [b'{"ok":1}', b"", bad, b'{"ok":2}'])
    with pytest.raises(InputError) as want:
        list(JsonlReader(merged, strict=True, missing_ok=False))
    with pytest.raises(InputError) as got:
        list(iter_merged(merged))
    assert str(got.value) == str(want.value)
    assert str(got.value).startswith(f"{merged}:3: not a JSON object (")
    assert (got.value.path, got.value.line) == (want.value.path, want.value.line) == (str(merged), 3)


def test_a_missing_merged_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(iter_merged(tmp_path / "absent.jsonl"))


def test_compact_plain_holds_the_value_json_writes_for_every_record_orjson_reads(tmp_path: Path) -> None:
    merged = tmp_path / "rollouts.jsonl"
    rng = random.Random(9)
    floats = [struct_float(rng) for _ in range(2000)] + [_random_float(rng) for _ in range(2000)]
    _write(merged, [*_records(rng, 1500), *_AWKWARD_LINES, json.dumps({"floats": floats}).encode()])
    checked = 0
    for record, plain in iter_merged(merged):
        if not plain:
            continue
        stripped = strip_for_aggregation(record)
        text = compact_plain(stripped)
        assert _same(json.loads(text), json.loads(json.dumps(stripped, separators=(",", ":"))))
        assert _same(json.loads(text), stripped)
        checked += 1
    assert checked > 1000


def test_compact_plain_of_nesting_orjson_will_not_write_is_json_s_text() -> None:
    deep: Any = 1.5
    for _ in range(300):  # orjson writes at most 255 levels
        deep = {"k": [deep]}
    assert compact_plain(deep) == json.dumps(deep, separators=(",", ":")).encode()
    assert not math.isnan(json.loads(compact_plain({"x": 1e-7}))["x"])


def _bodies(spools: ServerSpools, servers: list[str]) -> dict[str, Any]:
    return {s: json.loads(spools.write_body(s, threading.Event()).read_bytes()) for s in servers}


def test_group_merged_sends_each_server_the_values_group_results_sends_in_the_same_order(
    tmp_path: Path,
) -> None:
    merged = tmp_path / "rollouts.jsonl"
    awkward = [line[:-1] + b',"_ng_environment_server":"env_b","agent_ref":{"name":"ag1"}}' for line in
               _AWKWARD_LINES[:-1]]  # fmt: skip
    failure = b'{"_ng_failure_class":"x","_ng_environment_server":"env_a"}'  # not aggregated
    _write(merged, [*_records(random.Random(13), 600), *awkward, failure])
    topology = Topology.from_config(_base_config())
    slow, fast = ServerSpools(tmp_path / "slow"), ServerSpools(tmp_path / "fast")
    records = (record for _, record in JsonlReader(merged, strict=True, missing_ok=False))
    want = group_results(records, topology, slow, threading.Event())
    got = group_merged(merged, topology, fast, threading.Event())
    assert (got.counts, got.first_agent, got.errors) == (want.counts, want.first_agent, want.errors)
    assert sorted(got.counts) == ["env_a", "env_b"]
    want_bodies, got_bodies = _bodies(slow, ["env_a", "env_b"]), _bodies(fast, ["env_a", "env_b"])
    assert _same(got_bodies, want_bodies)
    assert len(got_bodies["env_b"]["verify_responses"]) == got.counts["env_b"]
    slow.remove()
    fast.remove()


async def test_the_server_receives_the_values_and_order_of_before_and_the_metrics_file_is_the_same(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rng = random.Random(17)
    lines = []
    for index, line in enumerate(_records(rng, 300)):  # one server; each rollout once; finite rewards
        record = json.loads(line)
        record["_ng_environment_server"] = "env_rec"
        record["_ng_task_index"], record["_ng_rollout_index"] = 99 - index // 3, index % 3  # unordered
        record["reward"] = rng.choice([0.0, 1.0, 0.25, 1e-7, 3.0e16])
        record["response"] = {"usage": {"input_tokens": index, "output_tokens": 2, "total_tokens": index + 2}}
        record["payload"] = [record["payload"]] if rng.random() < 0.5 else "é漢😀\u2028"  # not a metric
        lines.append(json.dumps(record, ensure_ascii=rng.random() < 0.5, separators=(",", ":")).encode())
    _write(run_dir / "rollouts.jsonl", lines)
    recorder = _Recorder()
    async with recorder.serving() as port:
        env = {
            "environment_servers": {"recorder": {"host": _HOST, "port": port, "agent_server": _ref("ag1")}}
        }
        topology = Topology.from_config({"ag1": _agent("ag1"), "env_rec": env})
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            slow = tmp_path / "slow.json"
            records = (record for _, record in JsonlReader(run_dir / "rollouts.jsonl", strict=True))
            await aggregate_metrics(records, topology, client, output_path=slow, raise_on_error=False)
            fast = await aggregate_run(run_dir, topology, client, output_path=tmp_path / "fast.json")
    assert fast is not None
    assert len(recorder.bodies) == 2
    assert _same(recorder.bodies[1], recorder.bodies[0])
    assert recorder.raw[1] != recorder.raw[0]  # other bytes (UTF-8, orjson's floats): the fast path ran
    assert len(recorder.bodies[1]["verify_responses"]) == 300
    assert fast.read_bytes() == slow.read_bytes()
    (entry,) = json.loads(fast.read_text(encoding="utf-8"))
    assert "aggregation_error" not in entry
    assert len(entry["group_level_metrics"]) == len({json.loads(line)["_ng_task_index"] for line in lines})

"""The common-row path of preprocessing gives exactly what the general path gives (planned bytes, task and
rollout numbers, errors), and takes only the rows it is sure of."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import GymRayError, InputError
from gym_ray.plan import _common_rows
from gym_ray.plan._common_rows import CommonRows
from gym_ray.plan._compact_index import CompactIndex, DenseCounters
from gym_ray.plan.shards import iter_prepare_run, prepare_run
from gym_ray.record.manifest import read_manifest
from gym_ray.servers import load_bundled_config


def _row(question: str, agent: str = "arith_agent", **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": question}, "agent_ref": {"name": agent}, **extra}


def _varied_lines() -> list[str]:
    """Common rows mixed with every shape the common path hands back to the general path."""
    rows: list[Any] = [
        _row("q0", meta={"b": 1, "a": [1.5, "é"]}),
        _row("q1", agent="arith_agent_hard"),
        _row("q0", meta={"a": [1.5, "é"], "b": 1}),  # row 0 again, keys in another order
        _row("q2", note=None),  # a null: the digest takes json's form
        _row("q3", big=2**70),  # past 64 bits: json reads it
        _row("q4", _ng_task_index=7),  # the caller's task index is kept
        _row("q5", _ng_task_index=7),  # ... and shared: its rollouts continue task 7
        _row("q6", _ng_rollout_index=5, _ng_attempt_index=1),  # a stale rollout index is replaced
        {"responses_create_params": {"input": "q7"}, "task_source": "arith_agent"},  # agent by task_source
        _row("q8", task_source="arith_agent"),
        {"responses_create_params": {"input": "q9"}, "_ng_environment_server": "arith_env"},  # stamped
        {"task_id": {"taskset": "arith", "task_id": "t1"}, "task_input": {"x": 1}},  # materialized
        {"task_id": {"taskset": "arith", "task_id": "t1"}, "task_input": {"x": 1}},  # ... twice
        _row("q10", task_id="plain"),  # a task_id that is not an object: a flat row
        {"responses_create_params": {"input": "q11"}, "agent_ref": {"name": "arith_agent", "x": [1, 2]}},
        _row("q1", agent="arith_agent_hard"),  # row 1 again
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines[2] = lines[2].replace(",", ", ")  # other whitespace, same content
    return lines


def _config(tmp_path: Path, name: str, input_path: Path, **extra: Any) -> RunConfig:
    return RunConfig.from_dict(
        {
            **load_bundled_config(),
            "environment_server_routes": {"arith": "arith_env"},
            "output_dir": str(tmp_path / name),
            "input_jsonl_fpath": str(input_path),
            **extra,
        }
    )


def _planned(tmp_path: Path, name: str, input_path: Path, **extra: Any) -> list[tuple[str, bytes, str]]:
    plan = prepare_run(_config(tmp_path, name, input_path, **extra))
    out = []
    rows = (extra.get("limit") or 16) * extra.get("num_repeats", 1)
    assert [spec.run_rows for spec in plan.shards] == [rows] * len(plan.shards)  # counted by pass 1
    assert sum(spec.num_rows for spec in plan.shards) == rows
    for spec in plan.shards:
        inputs = tmp_path / name / f"rollouts-{spec.shard}_materialized_inputs.jsonl"
        manifest = read_manifest(tmp_path / name, spec.shard)
        assert manifest is not None
        out.append((spec.shard, inputs.read_bytes(), manifest.inputs_digest))
    return out


@pytest.mark.parametrize(("num_repeats", "shard_size"), [(1, 4), (3, 4), (3, None)])
def test_both_paths_plan_the_same_shard_files_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_repeats: int, shard_size: int | None
) -> None:
    input_path = tmp_path / "rows.jsonl"
    input_path.write_text("\n".join(_varied_lines()) + "\n", encoding="utf-8")
    fast = _planned(tmp_path, "fast", input_path, shard_size=shard_size, num_repeats=num_repeats)
    monkeypatch.setattr(_common_rows, "ENABLED", False)
    general = _planned(tmp_path, "general", input_path, shard_size=shard_size, num_repeats=num_repeats)
    assert fast == general
    numbers = [
        (row["_ng_task_index"], row["_ng_rollout_index"])
        for _, data, _ in fast
        for row in map(json.loads, data.decode("utf-8").splitlines())
    ]
    # by hand: rows 0/2, 1/15 and 11/12 share a task by content, numbered by first sight; rows 5 and 6
    # keep their own task 7, which row 10 (the 8th distinct content) joins as its number is 7 too
    tasks = [0, 1, 0, 2, 3, 7, 7, 4, 5, 6, 7, 8, 8, 9, 10, 1]
    seen: dict[int, int] = {}
    expected = []
    for task in tasks:
        for _ in range(num_repeats):
            expected.append((task, seen.get(task, 0)))
            seen[task] = seen.get(task, 0) + 1
    assert numbers == expected


def test_with_a_limit_both_paths_plan_the_first_rows_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    input_path = tmp_path / "rows.jsonl"
    input_path.write_text("\n".join(_varied_lines()) + "\n", encoding="utf-8")
    fast = _planned(tmp_path, "fast", input_path, limit=5, num_repeats=2)
    monkeypatch.setattr(_common_rows, "ENABLED", False)
    assert fast == _planned(tmp_path, "general", input_path, limit=5, num_repeats=2)
    planned = [json.loads(line) for _, data, _ in fast for line in data.decode("utf-8").splitlines()]
    assert [r["responses_create_params"]["input"] for r in planned] == [
        "q0",
        "q0",
        "q1",
        "q1",
        "q0",
        "q0",
        "q2",
        "q2",
        "q3",
        "q3",
    ]


@pytest.mark.parametrize(
    ("bad_line", "fragment"),
    [
        pytest.param(
            json.dumps(_row("q", _ng_task_index=-1)),
            "rows.jsonl, line 4: the row's _ng_task_index must be an integer >= 0",
            id="task",
        ),
        pytest.param(
            json.dumps({"responses_create_params": {}, "_ng_environment_server": "nope"}),
            "rows.jsonl, line 4: the row cannot be routed: environment server 'nope' is not in the running "
            "config",
            id="stamp",
        ),
        pytest.param(
            json.dumps(_row("q", agent="arith_agnet")),
            "rows.jsonl, line 4: unknown agent: 'arith_agnet' is not in the running config (did you mean "
            "'arith_agent'?); ",
            id="agent",
        ),
    ],
)
def test_both_paths_refuse_a_bad_row_with_the_same_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_line: str, fragment: str
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _varied_lines()
    input_path.write_text("\n".join([*lines[:3], bad_line, *lines[3:]]) + "\n", encoding="utf-8")
    messages = []
    for enabled in (True, False):
        monkeypatch.setattr(_common_rows, "ENABLED", enabled)
        with pytest.raises(GymRayError) as caught:
            prepare_run(_config(tmp_path, f"run-{enabled}", input_path))
        messages.append(str(caught.value))
        assert not (tmp_path / f"run-{enabled}").exists() or not any((tmp_path / f"run-{enabled}").iterdir())
    assert messages[0] == messages[1]
    assert fragment in messages[0]


def test_the_common_path_takes_a_plain_row_and_hands_back_every_other_shape() -> None:
    counters, seen = DenseCounters(), set[str]()
    index = CompactIndex()

    def task_index(row: Any) -> int:
        return index.add(len(json.dumps(row, sort_keys=True)))

    common = CommonRows(num_repeats=2, task_index=task_index, next_rollout=counters, keys_seen=seen)
    row = _row("q", extra=1)
    assert common.expand(row) == [
        {**row, "_ng_task_index": 0, "_ng_rollout_index": 0},
        {**row, "_ng_task_index": 0, "_ng_rollout_index": 1},
    ]
    assert row == _row("q", extra=1)  # not mutated
    assert seen == {"arith_agent"}
    for other in (
        [row],
        {"responses_create_params": {"input": "q"}, "task_source": "arith_agent"},
        _row("q", _ng_environment_server="arith_env"),
        _row("q", task_id="plain"),
        {"responses_create_params": "q", "agent_ref": {"name": "a"}},
        {"responses_create_params": {}, "agent_ref": "a"},
        {"responses_create_params": {}, "agent_ref": {"name": ""}},
        _row("q", _ng_task_index=-1),
        _row("q", _ng_task_index=True),
        _row("q", _ng_task_index="3"),
    ):
        assert common.expand(other) is None
    # nothing numbered or counted for the rows handed back
    assert len(index) == 1
    assert counters.get(0) == 2


def test_an_input_edited_between_the_two_passes_is_refused(tmp_path: Path) -> None:
    # 3,000 rows (well over one read block): the first shard is cut while the end is still unread.
    input_path = tmp_path / "rows.jsonl"
    lines = [json.dumps(_row(f"q{i:05d}")) for i in range(3000)]
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    shards = iter_prepare_run(_config(tmp_path, "run", input_path, shard_size=10))
    first = next(shards)
    assert (first.num_rows, first.run_rows) == (10, 3000)
    lines[-1] = lines[-1].replace("q02999", "z02999")  # same length, other content
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"the input changed between .* \(the rows' contents differ\)"):
        list(shards)

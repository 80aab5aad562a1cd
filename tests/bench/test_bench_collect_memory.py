"""Smoke test of the single-process collection memory benchmark (tiny sizes; figures not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_ray.bench.collect_memory import collect_rows, run_collect_memory_bench, write_input
from gym_ray.errors import UsageError

RUN_KEYS = {
    "rows",
    "stage",
    "planned",
    "succeeded",
    "failed",
    "baseline_rss_mb",
    "peak_rss_mb",
    "children_peak_rss_mb",
    "wall_s",
    "rollouts_per_s",
    "cpu_us_per_rollout",
    "children_cpu_s",
    "first_shard_s",
}


def test_write_input_rows_are_distinct_and_unindexed(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    write_input(path, 3)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == list(collect_rows(3))
    assert [r["responses_create_params"]["input"][0]["content"] for r in rows] == [
        "What is 0 + 3?",
        "What is 1 + 3?",
        "What is 2 + 3?",
    ]
    assert all("_ng_task_index" not in r and "_ng_rollout_index" not in r for r in rows)


def test_bench_collects_every_row_in_a_fresh_process() -> None:
    result = run_collect_memory_bench((200, 400), max_resident_tasks=32)
    assert set(result) == {"max_resident_tasks", "runs", "peak_ratio", "max_peak_rss_mb"}
    assert [(r["rows"], r["planned"], r["succeeded"], r["failed"]) for r in result["runs"]] == [
        (200, 200, 200, 0),
        (400, 400, 400, 0),
    ]
    assert all(set(r) == RUN_KEYS and r["stage"] == "collect" for r in result["runs"])
    assert [r["first_shard_s"] for r in result["runs"]] == [None, None]


def test_plan_stage_plans_every_row_and_calls_no_server() -> None:
    result = run_collect_memory_bench((150,), stage="plan")
    assert [(r["stage"], r["rows"], r["planned"], r["succeeded"], r["failed"]) for r in result["runs"]] == [
        ("plan", 150, 150, 0, 0)
    ]
    (run,) = result["runs"]
    assert set(run) == RUN_KEYS
    # planning CPU per input row, and the time to the first committed shard (within the whole run)
    assert run["cpu_us_per_rollout"] > 0
    assert run["children_cpu_s"] == 0.0  # a small file: validated in this process
    assert 0 < run["first_shard_s"] <= run["wall_s"]


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(UsageError, match="stage='merge': give 'collect'"):
        run_collect_memory_bench((5,), stage="merge")


@pytest.mark.parametrize(
    ("sizes", "trace_top"),
    [
        pytest.param((), 0, id="no-sizes"),
        pytest.param((0,), 0, id="zero-size"),
        pytest.param((5,), -1, id="neg-trace"),
    ],
)
def test_bad_arguments_are_refused(sizes: tuple[int, ...], trace_top: int) -> None:
    with pytest.raises(UsageError):
        run_collect_memory_bench(sizes, trace_top=trace_top)

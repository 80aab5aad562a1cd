"""Smoke test of the merge benchmark (tiny sizes; figures not asserted, only what they are made of)."""

from __future__ import annotations

import json
from pathlib import Path

from gym_ray import keys
from gym_ray.bench.merge_bench import ROLLOUTS_PER_TASK, run_merge_bench, write_shards
from gym_ray.record.line_index import index_blocks


def test_shards_are_blocks_of_tasks_in_shuffled_order(tmp_path: Path) -> None:
    written = write_shards(tmp_path, 10, 2)
    assert (written["rows"], written["shards"]) == (10, 2)
    identities = []
    for shard in ("00000", "00001"):
        lines = (tmp_path / f"rollouts-{shard}.jsonl").read_bytes().splitlines()
        identities.append([(r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX]) for r in map(json.loads, lines)])
    # 10 rows of 4 rollouts per task: tasks 0-1 in the first shard, task 2 (rollouts 0 and 1) in the second
    assert ROLLOUTS_PER_TASK == 4
    assert sorted(identities[0]) == [(t, r) for t in (0, 1) for r in range(4)]
    assert sorted(identities[1]) == [(2, 0), (2, 1)]
    assert written["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("rollouts-*.jsonl"))
    # written by the shard writer: every line is covered by a verified batch of its line index
    for shard, count in (("00000", 8), ("00001", 2)):
        blocks = list(index_blocks(tmp_path / f"rollouts-{shard}.jsonl"))
        assert [None if block.lines is None else len(block.lines) for block in blocks] == [count]


def test_bench_reports_the_merging_and_the_sorting_processes_cpu() -> None:
    result = run_merge_bench(2000, 4)
    assert result["rows"] == 2000
    assert result["lines_per_s"] > 0
    # 2,000 rows are far below the pool's threshold: the merging process sorts every shard, no pool starts
    assert result["sorting_processes_cpu_s"] == 0
    assert result["merge_cpu_us_per_line"] == result["merge_cpu_s"] / 2000 * 1e6
    assert 0 < result["baseline_rss_mb"] <= result["peak_rss_mb"]


def test_the_tail_bench_ends_both_ways_with_the_same_metrics_and_groups_all_but_the_last_shard() -> None:
    from gym_ray.bench.tail_bench import run_tail_bench

    result = run_tail_bench(2000, 4)
    cold, ahead = result["cold"], result["ahead"]
    assert (cold["successes"], ahead["successes"]) == (2000, 2000)
    assert cold["metrics_sha256"] == ahead["metrics_sha256"]  # checked by the bench too
    assert ahead["grouped_ahead"] == 1500  # shards of 500 rows: every one but the last
    assert "grouped_ahead" not in cold
    assert result["cold_tail_s"] == cold["merge_s"] + cold["aggregate_s"]
    assert result["ahead_tail_s"] == ahead["merge_s"] + ahead["aggregate_s"]

"""Aggregation ahead of the run's end (issue 33 item 2): the merged prefix's rows grouped while the run goes
on, taken over by the run's aggregate only while the merged file is that prefix; the metrics file is the
one a cold aggregate writes. A real reference server on 127.0.0.1, real shard files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_ray.bench.dispatch import bench_config
from gym_ray.finalize import aggregate as aggregate_module
from gym_ray.finalize.aggregate import aggregate_run
from gym_ray.finalize.aggregate_ahead import AggregationAhead, claim, register
from gym_ray.finalize.merge import merge_shards
from gym_ray.finalize.merge_ahead import grow_prefix, reduce_ahead
from gym_ray.record.shard_files import list_shards, shard_paths
from tests.finalize.conftest import ROWS, SHARDS
from tests.finalize.test_aggregate import _deployment


def _refuse_grouping(*args: Any) -> Any:
    raise AssertionError("the merged file was read from its first row: the grouping made ahead was not used")


def _grow_ahead(run_dir: Path, topology: Any, shards: list[str]) -> AggregationAhead:
    """What the coordinator does after each accepted shard report, for ``shards`` (then offers it)."""
    grouping = AggregationAhead(run_dir, topology)
    planned = list_shards(run_dir)
    for shard in shards:
        assert reduce_ahead(run_dir, shard)
        grow_prefix(run_dir, planned)
        grouping.feed()
    register(run_dir, grouping)
    return grouping


def _spool_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".aggregate-"))


async def test_the_prefix_grouped_ahead_is_taken_over_and_the_metrics_file_is_a_cold_aggregates(
    two_copies: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cold, ahead = two_copies
    async with _deployment(bench_config()) as (deployment, topology, client):
        merge_shards(cold)
        expected = await aggregate_run(cold, topology, client)
        grouping = _grow_ahead(ahead, topology, list_shards(ahead)[:-1])
        assert grouping.rows_grouped == ROWS * (SHARDS - 1) // SHARDS  # the first three shards' rows
        assert len(_spool_folders(ahead)) == 1
        merge_shards(ahead)  # renames the prefix into place and appends the last shard
        monkeypatch.setattr(aggregate_module, "group_merged", _refuse_grouping)
        written = await aggregate_run(ahead, topology, client)
        calls = deployment.stats("bench_env").aggregate_calls
    assert expected is not None
    assert written is not None
    assert written.read_bytes() == expected.read_bytes()
    assert calls == 2  # once per aggregate, each with every row
    assert _spool_folders(ahead) == []
    assert claim(ahead) is None


async def test_a_prefix_the_merge_did_not_use_is_dropped_and_the_merged_file_read_whole(
    two_copies: tuple[Path, Path],
) -> None:
    cold, ahead = two_copies
    async with _deployment(bench_config()) as (_, topology, client):
        grouping = _grow_ahead(ahead, topology, list_shards(ahead)[:2])
        assert grouping.rows_grouped == ROWS // 2
        # a line added to the first shard after its reduction (a resumed shard's new record), in both
        # copies: the prefix no longer holds, the merge is cold and writes a new file
        first = list_shards(cold)[0]
        for run_dir in (cold, ahead):
            path = shard_paths(run_dir, first).successes
            path.write_bytes(path.read_bytes() + path.read_bytes().splitlines(keepends=True)[0])
        merge_shards(cold)
        merge_shards(ahead)
        expected = await aggregate_run(cold, topology, client)
        written = await aggregate_run(ahead, topology, client)
    assert expected is not None
    assert written is not None
    assert written.read_bytes() == expected.read_bytes()
    assert _spool_folders(ahead) == []

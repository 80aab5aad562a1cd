"""The automatic shard size: about four shards per worker, bounded, and stable across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.plan.shards import auto_shard_size, prepare_run
from gym_ray.servers import load_bundled_config


@pytest.mark.parametrize(
    ("rows", "workers", "expected"),
    [
        pytest.param(800, 2, 100, id="800-rows-2-workers"),
        pytest.param(801, 2, 101, id="rounds-up"),
        pytest.param(20_000, 2, 1000, id="capped-at-1000"),
        pytest.param(40, 4, 16, id="at-least-16"),
        pytest.param(0, 1, 16, id="empty"),
        pytest.param(1_000_000, 64, 1000, id="large-cluster"),
    ],
)
def test_auto_shard_size(rows: int, workers: int, expected: int) -> None:
    assert auto_shard_size(rows, workers) == expected


def _rows(count: int) -> list[dict[str, object]]:
    return [
        {"responses_create_params": {"input": f"q{i}"}, "agent_ref": {"name": "arith_agent"}}
        for i in range(count)
    ]


def test_a_resume_with_another_worker_count_cuts_the_same_shards(tmp_path: Path) -> None:
    run = RunConfig.from_dict({**load_bundled_config(), "output_dir": str(tmp_path)})
    first = prepare_run(run, rows=_rows(100), num_workers=2)
    assert [s.num_rows for s in first.shards] == [16, 16, 16, 16, 16, 16, 4]
    again = prepare_run(run, rows=_rows(100), num_workers=5)
    assert again.shards == first.shards
    assert again.resumed
    assert json.loads((tmp_path / "run_manifest.json").read_text())["shard_size"] == 16


def test_an_explicit_shard_size_wins(tmp_path: Path) -> None:
    run = RunConfig.from_dict({**load_bundled_config(), "output_dir": str(tmp_path), "shard_size": 30})
    plan = prepare_run(run, rows=_rows(100), num_workers=8)
    assert [s.num_rows for s in plan.shards] == [30, 30, 30, 10]

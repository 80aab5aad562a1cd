"""``gym-ray bench pipeline``: the floor and ``gym-ray run --local`` measured in one invocation (few rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_ray.bench.pipeline import run_pipeline_bench
from gym_ray.run.stage_cpu import STAGE_CPU_ENV, STAGES, StageCpu, stage_cpu_scope

SIDE_KEYS = {
    "wall_s",
    "cpu_s",
    "peak_rss_mb",
    "startup_cpu_s",
    "cpu_us_per_rollout",
    "work_cpu_us_per_rollout",
}


def test_pipeline_bench_reports_both_sides_the_stage_split_and_the_ratios() -> None:
    rows = 300
    result = run_pipeline_bench(rows, concurrency=32)
    assert set(result) == {"rows", "concurrency", "floor", "gym_ray", "ratios"}
    assert (result["rows"], result["concurrency"]) == (rows, 32)
    floor, run = result["floor"], result["gym_ray"]
    assert set(floor) == {*SIDE_KEYS, "cpu_s_runs"}
    assert len(floor["cpu_s_runs"]) == 2
    assert floor["cpu_s"] == min(floor["cpu_s_runs"])
    assert set(run) == {*SIDE_KEYS, "stages"}
    assert list(run["stages"]) == ["startup", *STAGES, "other"]
    for side in (floor, run):
        assert side["peak_rss_mb"] > 0
        assert 0 < side["startup_cpu_s"] < side["cpu_s"]
        assert side["cpu_us_per_rollout"] == pytest.approx(side["cpu_s"] / rows * 1e6, abs=0.1)
    # every stage of a run that dispatched, recorded, merged and aggregated cost something
    assert all(run["stages"][name]["cpu_s"] > 0 for name in STAGES)
    # the measured stages never claim more CPU than the whole command used (rounding to 1 ms each)
    measured = sum(v["cpu_s"] for name, v in run["stages"].items() if name != "other")
    assert measured <= run["cpu_s"] + 0.001 * len(run["stages"])
    assert sum(v["cpu_s"] for v in run["stages"].values()) == pytest.approx(run["cpu_s"], abs=0.01)
    assert result["ratios"]["cpu_per_rollout"] == pytest.approx(
        run["cpu_us_per_rollout"] / floor["cpu_us_per_rollout"], abs=0.001
    )
    assert result["ratios"]["peak_rss"] == pytest.approx(run["peak_rss_mb"] / floor["peak_rss_mb"], abs=0.001)


def test_stage_cpu_reports_dispatch_net_of_the_record_time_it_encloses() -> None:
    stage_cpu = StageCpu()
    stage_cpu.add("dispatch", 5.0)
    stage_cpu.add("record", 1.5)
    stage_cpu.add("merge", 0.25)
    expected = {"plan": 0.0, "dispatch": 3.5, "record": 1.5, "merge": 0.25, "aggregate": 0.0}
    assert stage_cpu.stages() == expected
    with pytest.raises(KeyError), stage_cpu.measure("planning"):
        pass


def test_stage_cpu_scope_writes_the_file_only_when_asked(tmp_path: Path) -> None:
    with stage_cpu_scope({}) as off:
        assert off is None
    target = tmp_path / "stages.json"
    with stage_cpu_scope({STAGE_CPU_ENV: str(target)}) as on:
        assert on is not None
        with on.measure("plan"):
            sum(range(100_000))
    report = json.loads(target.read_text())
    assert set(report) == {"stages", "process_cpu_at_start_s", "process_cpu_s", "peak_rss_mb"}
    assert list(report["stages"]) == list(STAGES)
    assert report["stages"]["plan"] > 0
    assert report["stages"]["plan"] + report["process_cpu_at_start_s"] <= report["process_cpu_s"]

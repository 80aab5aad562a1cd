import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gym_ray.run.demo import demo_main, format_result
from gym_ray.run.result import RunResult


def test_format_result_shows_counts_latency_headline_metrics_and_paths(tmp_path: Path) -> None:
    metrics = tmp_path / "rollouts_aggregate_metrics.json"
    metrics.write_text(
        json.dumps(
            [
                {
                    "_ng_environment_server": "env_b",
                    "agent_metrics": {"num_repeats": 2, "pass@2/accuracy": 75.0, "mean/reward": 0.5},
                    "key_metrics": {"mean/reward": 0.5},
                },
                {
                    "_ng_environment_server": "env_a",
                    "agent_metrics": {"num_repeats": 2, "pass@2/accuracy": 100.0},
                    "key_metrics": {"mean/reward": 0.75},
                },
            ]
        )
    )
    result = RunResult(
        run_dir=str(tmp_path),
        run_id="r1",
        rollouts_path="R",
        failures_path="F",
        metrics_path=str(metrics),
        summary_path="S",
        planned=8,
        succeeded=7,
        failed=1,
        failed_by_class={"agent_run_error": 1},
        omitted=0,
        dispatched=8,
        already_done=0,
        wall_s=2.0,
        rollouts_per_s=4.0,
        num_workers=2,
        key_metrics={},
        aggregation_errors={},
        latency_ms={"mean": 12.0, "p50": 10.0, "p99": 30.0},
        pending=0,
        failure_attempts=2,
        resumable=1,
        complete=False,
    )
    assert format_result(result).splitlines() == [
        "run r1: 7 succeeded, 1 failed, 0 pending of 8 planned rollouts (2 failed attempts; 0 already on "
        "disk, 8 dispatched)",
        "wall 2.0 s, 4 rollouts/s, 2 workers",
        "rollout latency p50 10 ms, p99 30 ms",
        "failures by class: agent_run_error=1",
        "",
        "environment server  mean/reward  pass@2/accuracy",
        "env_a                     0.750          100.000",
        "env_b                     0.500           75.000",
        "",
        "rollouts:  R",
        "failures:  F",
        f"metrics:   {metrics}",
        "summary:   S",
    ]


def _result(tmp_path: Path, **fields: Any) -> RunResult:
    base: dict[str, Any] = {
        "run_dir": str(tmp_path),
        "run_id": "r1",
        "rollouts_path": "R",
        "failures_path": "F",
        "metrics_path": None,
        "summary_path": "S",
        "planned": 3,
        "succeeded": 0,
        "failed": 3,
        "failed_by_class": {"agent_run_error": 3},
        "omitted": 0,
        "dispatched": 3,
        "already_done": 0,
        "wall_s": 0.2,
        "rollouts_per_s": 13.0,
        "num_workers": 1,
        "key_metrics": {},
        "aggregation_errors": {},
        "latency_ms": {"mean": None, "p50": None, "p99": None},
        "pending": 0,
        "failure_attempts": 3,
        "resumable": 0,
        "complete": False,
    }
    return RunResult(**{**base, **fields})


def test_a_run_where_every_row_failed_shows_no_table_and_says_why_there_are_no_metrics(
    tmp_path: Path,
) -> None:
    """Issue 30: "metrics: None", an empty table header and "1 workers" for a run where every row failed."""
    assert format_result(_result(tmp_path)).splitlines() == [
        "run r1: 0 succeeded, 3 failed, 0 pending of 3 planned rollouts (3 failed attempts; 0 already on "
        "disk, 3 dispatched)",
        "wall 0.2 s, 13 rollouts/s, 1 worker",
        "failures by class: agent_run_error=3",
        "",
        "rollouts:  R",
        "failures:  F",
        "metrics:   none (no rollout succeeded: nothing to aggregate)",
        "summary:   S",
    ]


def test_a_run_with_aggregation_off_says_so_instead_of_none(tmp_path: Path) -> None:
    result = _result(tmp_path, succeeded=3, failed=0, failed_by_class={}, failure_attempts=0, complete=True)
    assert "metrics:   none (aggregation is off: disable_aggregation)" in format_result(result).splitlines()


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_the_demo_prints_the_ledger_as_a_line_and_counts_one_worker(
    ray_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30: the demo printed the ledger as a raw dict ("wasted_requests None") and "1 workers"."""
    out = tmp_path / "demo"
    status = demo_main(argparse.Namespace(workers=1, repeats=1, output_dir=str(out), address=None))
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert f"collecting into {out} with 1 worker on Ray ..." in lines
    assert re.fullmatch(r"wall \d+\.\d s, \d+ rollouts/s, 1 worker", lines[lines.index("") + 2]), lines
    # 200 bundled tasks, each to both environment servers (fan_out), once
    assert lines[-1] == (
        "ledger:    ok: lost 0, missing 0, duplicates 0, unexpected 0, corrupt lines 0, "
        "unidentified lines 0, unplanned 0; planned 400, recorded 400, settled 400"
    )

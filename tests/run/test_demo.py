import json
from pathlib import Path

from gym_ray.run.demo import format_result
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

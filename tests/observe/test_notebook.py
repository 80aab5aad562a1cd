"""gym_ray.observe.notebook: tables, progress and plots (real files in tmp_path)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import InputError
from gym_ray.observe.notebook import (
    Progress,
    pass_at_k_curves,
    plot_latency_histogram,
    plot_pass_at_k,
    plot_reward_distribution,
    plot_throughput,
    to_arrow,
)

ROW = {keys.TASK_INDEX: 3, keys.ROLLOUT_INDEX: 1, keys.AGENT_REF: {"name": "a"}}
RESULT = {
    keys.REWARD: 1.0,
    keys.TASK_INDEX: 3,
    keys.ROLLOUT_INDEX: 1,
    keys.ENVIRONMENT_SERVER: "env",
    keys.NG_PERF: {"total_latency_ms": 12.5},
}
FAILURE = RolloutFailureRecord(
    failure_class="agent_run_error", message="boom", task_index=4, rollout_index=0, environment_server="env"
)


def test_to_arrow_flattens_pairs_groups_and_records() -> None:
    table = to_arrow([(ROW, RESULT), [(ROW, FAILURE)], {**RESULT, keys.TASK_INDEX: 9}])
    assert table.to_pylist() == [
        {
            "task_index": 3,
            "rollout_index": 1,
            "environment_server": "env",
            "agent": "a",
            "reward": 1.0,
            "latency_ms": 12.5,
            "failure_class": None,
        },
        {
            "task_index": 4,
            "rollout_index": 0,
            "environment_server": "env",
            "agent": "a",
            "reward": None,
            "latency_ms": None,
            "failure_class": "agent_run_error",
        },
        {
            "task_index": 9,
            "rollout_index": 1,
            "environment_server": "env",
            "agent": None,
            "reward": 1.0,
            "latency_ms": 12.5,
            "failure_class": None,
        },
    ]


def test_to_arrow_names_a_bad_item() -> None:
    with pytest.raises(InputError, match="result 1 is a int"):
        to_arrow([(ROW, RESULT), 7])


def test_progress_text_fallback_and_per_second_bins() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = Progress(total=4, html=False, stream=out, clock=lambda: now[0])
    bar.update(2)
    now[0] = 1.5
    bar.update(2)
    bar.close()
    assert bar.per_second == {0: 2, 1: 2}
    assert out.getvalue().splitlines()[-1].endswith("rollouts: 4/4 [####################] 2.7/s")


def test_plots_write_non_empty_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "rollouts_aggregate_metrics.json"
    entry: dict[str, Any] = {
        keys.ENVIRONMENT_SERVER: "env",
        "agent_metrics": {"pass@1/accuracy": 40.0, "pass@4/accuracy": 80.0, "pass@2/accuracy": 60.0},
    }
    metrics.write_text(json.dumps([entry]))
    assert pass_at_k_curves([entry]) == {"env": [(1, 40.0), (2, 60.0), (4, 80.0)]}
    results = [(ROW, RESULT), (ROW, FAILURE)]
    paths = [tmp_path / name for name in ("r.png", "l.png", "t.png", "p.png")]
    plot_reward_distribution(results, path=paths[0])
    plot_latency_histogram(results, path=paths[1])
    plot_throughput({0: 3, 2: 1}, path=paths[2])
    plot_pass_at_k(tmp_path, path=paths[3])
    assert [p.stat().st_size > 0 for p in paths] == [True] * 4


def test_pass_at_k_without_metrics_is_an_input_error() -> None:
    with pytest.raises(InputError, match="no aggregate metric entry has pass@k"):
        plot_pass_at_k([{"agent_metrics": {"mean/reward": 1.0}}])

"""compute_aggregate_metrics: NeMo Gym's default statistics plus pass@k, against hand-computed values."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gym_ray.errors import InputError
from gym_ray.servers import compute_aggregate_metrics, serve_config
from gym_ray.servers.metrics import compute_pass_majority_metrics, pass_at_k

_USAGE = {
    "input_tokens": 20,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 10,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 30,
}


def _vr(task: int, rollout: int, reward: float, answer: str | None = "x", **extra: Any) -> dict[str, Any]:
    return {
        "reward": reward,
        "extracted_answer": answer,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        **extra,
    }


def test_matches_the_nemo_gym_capture_exactly() -> None:
    """The 0.7.0 wire capture: 2 tasks x 1 rollout, bools/None/strings ignored, usage merged."""
    vrs = [
        {
            "reward": 1.0,
            "mask_sample": False,
            "failure_kind": None,
            "failure_reason": None,
            "_ng_task_index": t,
            "_ng_rollout_index": 0,
            "agent_ref": {"name": "example_single_tool_call_simple_agent"},
            "_ng_environment_server": "env",
            "_ng_result_type": "legacy_agent",
            "response": {"usage": _USAGE},
        }
        for t in (0, 1)
    ]
    stats = {
        f"{stat}/{field}": value
        for stat in ("mean", "max", "min", "median", "std")
        for field, value in (
            ("reward", 1.0),
            ("input_tokens", 20.0),
            ("output_tokens", 10.0),
            ("total_tokens", 30.0),
        )
    }
    for key in [k for k in stats if k.startswith("std/")]:
        stats[key] = 0.0
    got = compute_aggregate_metrics(vrs, answer_key=None)
    assert got["group_level_metrics"][1] == {
        "_ng_task_index": 1,
        **stats,
        "sample": {"agent_ref": {"name": "agent"}},
        "num_rollouts": 1,
        "expected_num_rollouts": 1,
        "missing_num_rollouts": 0,
        "reward_profile_completion_pct": 100.0,
        "rollout_infos": [
            {
                "rollout_id": "1:0",
                "_ng_task_index": 1,
                "_ng_rollout_index": 0,
                "reward": 1.0,
                "input_tokens": 20,
                "output_tokens": 10,
                "total_tokens": 30,
            }
        ],
    }
    assert list(got["group_level_metrics"][0])[:3] == ["_ng_task_index", "mean/reward", "mean/input_tokens"]
    assert list(got) == [
        "group_level_metrics",
        "agent_metrics",
        "key_metrics",
        "perf_summary",
        "repeat_level_metrics",
    ]
    assert (got["perf_summary"], got["repeat_level_metrics"]) == (None, [])
    assert got["agent_metrics"] == {
        **stats,
        "num_repeats": 1,
        "pass@1/accuracy": 100.0,
        "pass@1[avg-of-1]/accuracy": 100.0,
        "per_sample_aggregate": {"accuracy": [100.0]},
    }
    assert got["key_metrics"] == {k: v for k, v in stats.items() if k.startswith("mean/")}
    assert list(got["key_metrics"]) == [
        "mean/reward",
        "mean/input_tokens",
        "mean/output_tokens",
        "mean/total_tokens",
    ]


# Task 0: n=4, c=1 (answers 42 41 41 43); task 1: n=4, c=2 (answers 7 7 8 -), given out of order.
_PASS_K_INPUT = [
    _vr(1, 3, 0.0, None),
    _vr(0, 0, 1.0, "42"),
    _vr(0, 1, 0.0, "41"),
    _vr(1, 0, 1.0, "7"),
    _vr(0, 2, 0.0, "41"),
    _vr(0, 3, 0.0, "43"),
    _vr(1, 1, 1.0, "7"),
    _vr(1, 2, 0.0, "8"),
]


def test_stats_per_task_and_overall() -> None:
    got = compute_aggregate_metrics(_PASS_K_INPUT)
    g0, g1 = got["group_level_metrics"]
    assert (g0["_ng_task_index"], g1["_ng_task_index"]) == (0, 1)
    assert (g0["mean/reward"], g0["median/reward"], g0["max/reward"], g0["min/reward"]) == (
        0.25,
        0.0,
        1.0,
        0.0,
    )
    assert g0["std/reward"] == pytest.approx(0.5)
    assert (g1["mean/reward"], g1["median/reward"]) == (0.5, 0.5)
    assert g1["std/reward"] == pytest.approx(math.sqrt(1 / 3))
    assert [i["rollout_id"] for i in g1["rollout_infos"]] == ["1:0", "1:1", "1:2", "1:3"]
    assert g1["rollout_infos"][3] == {
        "rollout_id": "1:3",
        "_ng_task_index": 1,
        "_ng_rollout_index": 3,
        "reward": 0.0,
    }
    assert (g1["num_rollouts"], g1["expected_num_rollouts"], g1["missing_num_rollouts"]) == (4, 4, 0)
    am = got["agent_metrics"]
    assert (am["mean/reward"], am["median/reward"], am["num_repeats"]) == (0.375, 0.0, 4)
    assert am["std/reward"] == pytest.approx(math.sqrt(1.875 / 7))
    assert got["key_metrics"] == {"mean/reward": 0.375}


def test_pass_at_k_unbiased_estimator_n4_c1_c2() -> None:
    am = compute_aggregate_metrics(_PASS_K_INPUT)["agent_metrics"]
    # c=1: 1 - C(3,k)/C(4,k) = .25, .5, .75, 1; c=2: 1 - C(2,k)/C(4,k) = .5, 5/6, 1, 1
    assert am["pass@1/accuracy"] == pytest.approx(100 * (0.25 + 0.5) / 2)
    assert am["pass@2/accuracy"] == pytest.approx(100 * (0.5 + 5 / 6) / 2)
    assert am["pass@3/accuracy"] == pytest.approx(100 * (0.75 + 1.0) / 2)
    assert am["pass@4/accuracy"] == 100.0
    assert [am[f"pass@1[avg-of-{k}]/accuracy"] for k in (1, 2, 4)] == [100.0, 75.0, 37.5]
    assert am["pass@1[avg-of-3]/accuracy"] == pytest.approx(50.0)
    # majority over the first k answers; ties averaged; missing answers skipped
    assert [am[f"majority@{k}/accuracy"] for k in (1, 2, 3, 4)] == [100.0, 75.0, 50.0, 50.0]
    # no_answer: only task 1 rollout 3 -> binary n=4, c=1 for task 1, c=0 for task 0
    assert am["pass@1/no_answer"] == pytest.approx(12.5)
    assert am["pass@1[avg-of-4]/no_answer"] == pytest.approx(12.5)
    assert am["per_sample_aggregate"] == {
        "accuracy": [100.0, 50.0, 0.0, 0.0],
        "no_answer": [0.0, 0.0, 0.0, 50.0],
    }
    assert am["pass@1[avg-of-2]/accuracy/std_dev_across_runs"] == pytest.approx(math.sqrt(1250))
    assert am["pass@1[avg-of-2]/accuracy/std_err_across_runs"] == pytest.approx(25.0)
    assert not [k for k in compute_aggregate_metrics(_PASS_K_INPUT)["key_metrics"] if "@" in k]


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        pytest.param(4, 1, 1, 0.25, id="n4c1k1"),
        pytest.param(4, 1, 2, 0.5, id="n4c1k2"),
        pytest.param(4, 2, 2, 5 / 6, id="n4c2k2"),
        pytest.param(4, 0, 4, 0.0, id="none-correct"),
        pytest.param(4, 2, 3, 1.0, id="fewer-incorrect-than-k"),
    ],
)
def test_pass_at_k_formula(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_continuous_scores_use_max_of_first_k() -> None:
    tasks = [[{"reward": 0.2}, {"reward": 0.9}, {"reward": 0.5}]]
    got = compute_pass_majority_metrics(tasks)
    assert [got[f"pass@{k}/accuracy"] for k in (1, 2, 3)] == [pytest.approx(20.0), 90.0, 90.0]
    assert "majority@1/accuracy" not in got


def test_majority_off_without_answer_key_field() -> None:
    vrs = [{"reward": 1.0, "_ng_task_index": 0, "_ng_rollout_index": r} for r in range(2)]
    am = compute_aggregate_metrics(vrs)["agent_metrics"]
    assert not [k for k in am if k.startswith("majority@") or "no_answer" in k]


def test_single_sample_std_is_zero_and_partial_std_is_omitted() -> None:
    single = compute_aggregate_metrics([{"reward": 0.5, "latency_s": 2}])
    assert (single["agent_metrics"]["std/reward"], single["agent_metrics"]["std/latency_s"]) == (0.0, 0.0)
    mixed = compute_aggregate_metrics(
        [
            {"reward": 1.0, "judge_score": 5, "_ng_task_index": 0, "_ng_rollout_index": 0},
            {"reward": 0.0, "_ng_task_index": 0, "_ng_rollout_index": 1},
        ]
    )["agent_metrics"]
    assert (mixed["std/reward"], mixed["mean/judge_score"], mixed["median/judge_score"]) == (
        pytest.approx(math.sqrt(0.5)),
        5.0,
        5.0,
    )
    assert "std/judge_score" not in mixed


def test_only_numeric_non_private_fields_are_stats() -> None:
    got = compute_aggregate_metrics(
        [{"reward": 1, "ok": True, "name": "a", "nested": {"x": 1}, "_ng_attempt_index": 2, "n": None}]
    )
    assert sorted(got["key_metrics"]) == ["mean/reward"]
    assert got["group_level_metrics"][0]["_ng_task_index"] == 0
    assert got["group_level_metrics"][0]["rollout_infos"] == [
        {"rollout_id": "0:0", "_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1}
    ]


def test_missing_rollouts_are_reported_per_task() -> None:
    vrs = [_vr(0, r, 1.0) for r in range(4)] + [_vr(5, 0, 0.0)]
    g5 = compute_aggregate_metrics(vrs)["group_level_metrics"][1]
    assert (g5["_ng_task_index"], g5["num_rollouts"], g5["expected_num_rollouts"]) == (5, 1, 4)
    assert (g5["missing_num_rollouts"], g5["reward_profile_completion_pct"]) == (3, 25.0)


def test_empty_input() -> None:
    assert compute_aggregate_metrics([]) == {
        "group_level_metrics": [],
        "agent_metrics": {},
        "key_metrics": {},
        "perf_summary": None,
        "repeat_level_metrics": [],
    }


@pytest.mark.parametrize(
    ("vrs", "message"),
    [
        pytest.param([_vr(0, 1, 1.0), _vr(0, 1, 0.0)], "verify_responses[1] repeats", id="duplicate"),
        pytest.param(
            [{"reward": 1.0, "_ng_task_index": "a"}], "_ng_task_index = 'a' is not an integer", id="index"
        ),
        pytest.param([[1]], "verify_responses[0] is a list", id="not-object"),
    ],
)
def test_bad_input_raises_input_error(vrs: list[Any], message: str) -> None:
    with pytest.raises(InputError) as info:
        compute_aggregate_metrics(vrs)
    assert message in str(info.value)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize(
    ("instance", "cfg"),
    [
        pytest.param("env", {"environment_servers": {"example_env": {"port": 0}}}, id="env"),
        pytest.param("agent", {"responses_api_agents": {"example_env": {"port": 0}}}, id="agent"),
        pytest.param("rs", {"resources_servers": {"example_resources": {"port": 0}}}, id="resources"),
    ],
)
async def test_endpoint_serves_the_same_computation(
    session: aiohttp.ClientSession, instance: str, cfg: dict[str, Any]
) -> None:
    async with serve_config({instance: cfg}) as d:
        url = d.url_of(instance) + "/aggregate_metrics"
        async with session.post(url, json={"verify_responses": _PASS_K_INPUT}) as resp:
            ok = (resp.status, await resp.json())
        async with session.post(url, json={"verify_responses": [_vr(0, 0, 1.0)] * 2}) as resp:
            dup = (resp.status, await resp.json())
        async with session.post(url, json={"verify_responses": {}}) as resp:
            not_list = (resp.status, await resp.json())
        calls = d.stats(instance).aggregate_calls
    assert ok == (200, compute_aggregate_metrics(_PASS_K_INPUT))
    assert dup[0] == 422
    assert "verify_responses[1] repeats" in dup[1]["error"]
    assert not_list[0] == 422
    assert "verify_responses = {} is not a list" in not_list[1]["error"]
    assert calls == 3

"""enrich_run_result: identity, model-call capture, ng_trajectory, exact ng_perf; end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.enrich import MODEL_CALL_CAPTURE_PATH, enrich_run_result
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.errors import InputError, UsageError
from gym_ray.servers import serve_config

ROW = {keys.TASK_INDEX: 4, keys.ROLLOUT_INDEX: 1, keys.AGENT_REF: {"name": "agent"}, "expected_answer": "7"}


def _known_result(capture_path: str | None = None) -> dict[str, Any]:
    """Two turns: (reasoning, function_call c1, function_call c2) -> outputs -> (message)."""
    output = [
        {"type": "reasoning", "id": "rs_1"},
        {"type": "function_call", "call_id": "c1", "name": "add"},
        {"type": "function_call", "call_id": "c2", "name": "mul"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": "4"},
        {"type": "message", "id": "msg_2", "role": "assistant", "content": []},
    ]
    result: dict[str, Any] = {
        "reward": 1.0,
        "response": {"id": "resp_2", "model": "m", "output": output, "usage": {"input_tokens": 1}},
    }
    if capture_path is not None:
        result[MODEL_CALL_CAPTURE_PATH] = capture_path
    return result


def _write_capture(path: Path) -> str:
    calls = [
        {
            "model_call_id": "call-a",
            "model_ref": "m",
            "response_id": "resp_1",
            "token_stats": {"prompt_tokens": 100, "cached_tokens": 40, "completion_tokens": 20},
            "request": {"input": "q"},
            "response": {"id": "resp_1"},
        },
        {
            "model_call_id": "call-b",
            "model_ref": "m",
            "response_id": "resp_2",
            "token_stats": {"prompt_tokens": 150, "completion_tokens": 5, "reasoning_tokens": 3},
            "request": {"input": "q2"},
            "response": {"id": "resp_2"},
        },
    ]
    path.write_text(json.dumps({"model_calls": calls}), encoding="utf-8")
    return str(path)


def test_known_trajectory_has_exact_ng_perf(tmp_path: Path) -> None:
    path = _write_capture(tmp_path / "cap.json")
    out = enrich_run_result(ROW, _known_result(path), observability_enabled=True, total_latency_ms=812.5)
    assert out["ng_perf"] == {
        "num_turns": 2,
        "num_tool_calls": 2,
        "token_observability_coverage": 1.0,
        "prompt_tokens": 250,
        "cached_prompt_tokens": 40,
        "completion_tokens": 25,
        "reasoning_tokens": 3,
        "total_latency_ms": 812.5,
    }
    trajectory = out["ng_trajectory"]
    assert [t["items"] for t in trajectory["turns"]] == [
        ["reasoning", "function_call", "function_call"],
        ["message"],
    ]
    assert trajectory["tool_calls"] == [
        {"call_id": "c1", "name": "add", "answered": True},
        {"call_id": "c2", "name": "mul", "answered": True},
    ]
    assert trajectory["token_stats"] == {
        "prompt_tokens": 250,
        "cached_tokens": 40,
        "completion_tokens": 25,
        "reasoning_tokens": 3,
    }
    assert trajectory["gaps"] == []
    assert (out[keys.TASK_INDEX], out[keys.ROLLOUT_INDEX], out[keys.AGENT_REF]) == (4, 1, {"name": "agent"})
    assert [c["request"] for c in out["ng_model_call_capture"]["model_calls"]] == [
        {"input": "q"},
        {"input": "q2"},
    ]
    assert Path(path).exists()


def test_without_capture_trajectory_comes_from_response_and_names_gaps() -> None:
    result = _known_result()
    result["response"]["output"] = result["response"]["output"][:2]  # c1 never answered
    out = enrich_run_result(ROW, result)
    assert "ng_model_call_capture" not in out
    assert out["ng_trajectory"]["gaps"] == ["no_model_call_capture", "tool_call_without_output:c1"]
    assert out["ng_perf"] == {
        "num_turns": 1,
        "num_tool_calls": 1,
        "token_observability_coverage": 1.0,
        "prompt_tokens": 1,
    }


def test_capture_ignored_when_observability_off(tmp_path: Path) -> None:
    path = _write_capture(tmp_path / "cap.json")
    out = enrich_run_result(ROW, _known_result(path), delete_model_call_capture=True)
    assert "ng_model_call_capture" not in out
    assert Path(path).exists()  # not merged, so not deleted
    assert out["ng_perf"]["num_turns"] == 2


def test_payloads_absent_when_not_included(tmp_path: Path) -> None:
    path = _write_capture(tmp_path / "cap.json")
    out = enrich_run_result(
        ROW, _known_result(path), observability_enabled=True, include_model_call_payloads=False
    )
    calls = out["ng_model_call_capture"]["model_calls"]
    assert [sorted(c) for c in calls] == [["model_call_id", "model_ref", "response_id", "token_stats"]] * 2


def test_delete_capture_removes_file_and_needs_payloads(tmp_path: Path) -> None:
    path = _write_capture(tmp_path / "cap.json")
    with pytest.raises(UsageError, match="include_model_call_payloads"):
        enrich_run_result(
            ROW,
            _known_result(path),
            observability_enabled=True,
            include_model_call_payloads=False,
            delete_model_call_capture=True,
        )
    out = enrich_run_result(
        ROW, _known_result(path), observability_enabled=True, delete_model_call_capture=True
    )
    assert not Path(path).exists()
    assert MODEL_CALL_CAPTURE_PATH not in out
    assert len(out["ng_model_call_capture"]["model_calls"]) == 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        pytest.param(None, "cannot be read", id="missing"),
        pytest.param("{not json", "is not JSON", id="not-json"),
        pytest.param('{"calls": []}', "'model_calls' list", id="wrong-shape"),
    ],
)
def test_bad_capture_file_names_the_file(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "cap.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=match) as info:
        enrich_run_result(ROW, _known_result(str(path)), observability_enabled=True)
    assert info.value.path == str(path)
    assert "task 4 rollout 1" in str(info.value)


def test_failure_result_gets_identity_only() -> None:
    failed = {keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True, keys.DISPATCH_DRAINED: True}
    assert enrich_run_result(ROW, failed) == {
        **failed,
        keys.TASK_INDEX: 4,
        keys.ROLLOUT_INDEX: 1,
        keys.AGENT_REF: {"name": "agent"},
    }


def _config(capture_dir: Path) -> dict[str, Any]:
    return {
        "observability_enabled": True,
        "agent": {"responses_api_agents": {"example_env": {"port": 0}}},
        "env": {
            "environment_servers": {
                "example_env": {
                    "port": 0,
                    "capture_dir": str(capture_dir),
                    "agent_server": {"type": "responses_api_agents", "name": "agent"},
                }
            }
        },
    }


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 2?"}]},
            "expected_answer": str(i + 2),
            "agent_ref": {"name": "agent"},
            keys.TASK_INDEX: i,
            keys.ROLLOUT_INDEX: 0,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("method", "delete"),
    [
        pytest.param("run_examples", False, id="examples-keep"),
        pytest.param("run_examples", True, id="examples-delete"),
        pytest.param("run_outcomes", True, id="outcomes-delete"),
    ],
)
async def test_reference_server_captures_end_to_end(tmp_path: Path, method: str, delete: bool) -> None:
    capture_dir = tmp_path / "captures"
    async with serve_config(_config(capture_dir)) as dep, RolloutCollectionHelper(dep.config) as helper:
        completions = getattr(helper, method)(_rows(3), enrich_results=True, delete_model_call_capture=delete)
        try:
            outcomes = [item async for item in completions]
        finally:
            await completions.aclose()
    assert len(outcomes) == 3
    for row, result in outcomes:
        usage = result["response"]["usage"]
        (call,) = result["ng_model_call_capture"]["model_calls"]
        assert call["request"] == row["responses_create_params"]
        assert call["response_id"] == result["response"]["id"]
        perf = result["ng_perf"]
        assert (perf["num_turns"], perf["num_tool_calls"], perf["token_observability_coverage"]) == (
            1,
            0,
            1.0,
        )
        assert (perf["prompt_tokens"], perf["completion_tokens"]) == (
            usage["input_tokens"],
            usage["output_tokens"],
        )
        assert perf["total_latency_ms"] > 0
        assert result[keys.TASK_INDEX] == row[keys.TASK_INDEX]
        assert result[keys.ENVIRONMENT_SERVER] == "env"
        assert (MODEL_CALL_CAPTURE_PATH in result) is not delete
    remaining = sorted(p.name for p in capture_dir.iterdir())
    assert remaining == ([] if delete else ["env-0-0.json", "env-1-0.json", "env-2-0.json"])


async def test_enrich_off_returns_exactly_what_run_returned(tmp_path: Path) -> None:
    async with serve_config(_config(tmp_path)) as dep, RolloutCollectionHelper(dep.config) as helper:
        completions = helper.run_examples(_rows(1))
        try:
            [(_row, result)] = [item async for item in completions]
        finally:
            await completions.aclose()
    assert sorted(result) == sorted(
        [
            "responses_create_params",
            "response",
            "reward",
            "expected_answer",
            "extracted_answer",
            MODEL_CALL_CAPTURE_PATH,
        ]
    )


def test_delete_without_payloads_is_rejected_at_call() -> None:
    helper = RolloutCollectionHelper(
        {"agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 1}}}}
    )
    with pytest.raises(UsageError, match="delete_model_call_capture"):
        helper.run_examples(
            [], enrich_results=True, include_model_call_payloads=False, delete_model_call_capture=True
        )

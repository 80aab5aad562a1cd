"""Failure records, completed records, drained results and reply classification."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from gym_ray.dispatch.outcomes import (
    RolloutFailureRecord,
    build_record,
    cap_body,
    classify_reply,
    drained_result,
)
from gym_ray.errors import ServerConnectionError, ServerHTTPError, ServerResponseError

ROW: dict[str, Any] = {
    "responses_create_params": {"input": "q"},
    "agent_ref": {"name": "ag"},
    "task_source": "rs",
    "_ng_task_index": 1,
    "_ng_rollout_index": 0,
    "_ng_environment_server": "env2",
    "_ng_run_id": "run-1",
}


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        pytest.param(
            ServerHTTPError("boom", status=500, body_excerpt="Internal boom"),
            {
                "_ng_failure_class": "agent_run_error",
                "_ng_failure_type": "ServerHTTPError",
                "_ng_failure_message": "boom",
                "_ng_failure_http_status": 500,
                "_ng_failure_response_body": "Internal boom",
            },
            id="500",
        ),
        pytest.param(
            ServerHTTPError("busy", status=503, body_excerpt=""),
            {
                "_ng_failure_class": "agent_request_failed",
                "_ng_failure_type": "ServerHTTPError",
                "_ng_failure_message": "busy",
                "_ng_failure_http_status": 503,
                "_ng_failure_response_body": None,
            },
            id="503",
        ),
        pytest.param(
            ServerConnectionError("refused"),
            {
                "_ng_failure_class": "agent_request_failed",
                "_ng_failure_type": "ServerConnectionError",
                "_ng_failure_message": "refused",
                "_ng_failure_http_status": None,
                "_ng_failure_response_body": None,
            },
            id="no_answer",
        ),
        pytest.param(
            ServerResponseError("bad json", status=200, body_excerpt='{"a": '),
            {
                "_ng_failure_class": "agent_run_error",
                "_ng_failure_type": "ServerResponseError",
                "_ng_failure_message": "bad json",
                "_ng_failure_http_status": 200,
                "_ng_failure_response_body": '{"a": ',
            },
            id="bad_json",
        ),
    ],
)
def test_from_exception_classifies(exc: Exception, expected: dict[str, Any]) -> None:
    record = RolloutFailureRecord.from_exception(exc, ROW)
    assert record.failure_fields() == expected
    assert record.to_row() == {
        **expected,
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
        "_ng_environment_server": "env2",
        "_ng_run_id": "run-1",
        "agent_ref": {"name": "ag"},
    }
    assert pickle.loads(pickle.dumps(record)) == record


def test_response_body_is_capped() -> None:
    assert cap_body("x" * 2001) == "x" * 2000 + "…"
    assert cap_body("x" * 2000) == "x" * 2000
    assert cap_body(b"\xff") == "\ufffd"
    record = RolloutFailureRecord.from_exception(
        ServerHTTPError("e", status=500, body_excerpt="y" * 5000), ROW
    )
    assert record.response_body == "y" * 2000 + "…"


def test_run_error_evidence() -> None:
    record = RolloutFailureRecord.from_exception(ServerHTTPError("boom", status=500), ROW, run_error=True)
    assert record.to_row()["run_error"] == "ServerHTTPError: boom"


def test_build_record_copies_identity_only_onto_the_record() -> None:
    result = {"reward": 1.0, "response": {}}
    record = build_record(ROW, result, environment_server="env2", result_type="example_env")
    assert record == {
        "reward": 1.0,
        "response": {},
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "ag"},
        "task_source": "rs",
        "_ng_run_id": "run-1",
        "_ng_environment_server": "env2",
        "_ng_result_type": "example_env",
    }
    assert result == {"reward": 1.0, "response": {}}
    failure = RolloutFailureRecord.from_exception(ServerConnectionError("x"), ROW)
    assert build_record(ROW, failure, environment_server="env2", result_type=None) == failure.to_row()


@pytest.mark.parametrize(
    ("remaining", "margin", "message"),
    [
        pytest.param(0.0, None, "not dispatched: dispatch budget exhausted", id="exhausted"),
        pytest.param(
            12.4, 30.0, "not dispatched: 12s left in dispatch budget, below the 30s drain margin", id="margin"
        ),
    ],
)
def test_drained_result(remaining: float, margin: float | None, message: str) -> None:
    assert drained_result(remaining, margin) == {
        "_ng_failure_class": "cancelled",
        "_ng_no_persist": True,
        "_ng_dispatch_drained": True,
        "error_message": message,
    }


MATERIALIZED = {"task_id": {"taskset": "ts", "task_id": "t"}, "task_input": {}, "_ng_task_index": 4}


def test_episode_failure_becomes_environment_server_failed() -> None:
    reply = {
        "episode_id": {"rollout_id": "4-0", "attempt": 0},
        "task_id": {"taskset": "ts", "task_id": "t"},
        "failure": {
            "failure_reason": "sandbox died",
            "terminal": False,
            "failure_kind": "infra",
            "stage": "seed",
        },
    }
    record = classify_reply(MATERIALIZED, reply, environment_server="env")
    assert isinstance(record, RolloutFailureRecord)
    assert record.to_row() == {
        "_ng_failure_class": "environment_server_failed",
        "_ng_failure_type": "infra",
        "_ng_failure_message": "sandbox died",
        "_ng_failure_terminal": False,
        "_ng_failure_stage": "seed",
        "_ng_task_index": 4,
        "_ng_environment_server": "env",
    }


def test_episode_result_is_flattened_with_task_id() -> None:
    reply = {"episode_id": {}, "task_id": {"taskset": "ts", "task_id": "t"}, "result": {"reward": 0.5}}
    assert classify_reply(MATERIALIZED, reply, environment_server="env") == {
        "reward": 0.5,
        "_ng_task_id": {"taskset": "ts", "task_id": "t"},
    }


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param({"reward": 1.0, "_ng_result_type": "x"}, id="private_key"),
        pytest.param({"reward": 1.0, "ng_perf": {}}, id="collector_owned"),
    ],
)
def test_reserved_keys_make_an_invalid_result(reply: dict[str, Any]) -> None:
    record = classify_reply(ROW, reply, environment_server="env2")
    assert isinstance(record, RolloutFailureRecord)
    assert record.failure_class == "invalid_result"
    assert "reserved for rollout collection" in record.message


def test_server_reported_failure_keys_are_allowed() -> None:
    reply = {"_ng_failure_class": "environment_server_failed", "_ng_failure_terminal": True, "reward": 0.0}
    assert classify_reply(ROW, reply, environment_server="env2") == reply

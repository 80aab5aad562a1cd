"""Fault injection: each configured or row-forced fault does what it says, deterministically."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gym_ray.errors import ConfigError, InputError
from gym_ray.servers import Deployment, serve_config
from gym_ray.servers.faults import Fault, FaultConfig, row_fault
from gym_ray.servers.policy import RolloutKey


def _cfg(faults: dict[str, Any] | None = None) -> dict[str, Any]:
    fields: dict[str, Any] = {"port": 0}
    if faults is not None:
        fields["faults"] = faults
    return {"env": {"environment_servers": {"example_env": fields}}}


def _row(task: int = 0, rollout: int = 0, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "responses_create_params": {"input": [{"role": "user", "content": "What is 2 + 2?"}]},
        "expected_answer": "4",
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        **extra,
    }
    if attempt:
        row["_ng_attempt_index"] = attempt
    return row


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _outcome(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[Any, ...]:
    """What a client sees: ("status", code, retry_after, body) or ("exc", exception type name)."""
    try:
        async with session.post(url, json=body) as resp:
            raw = await resp.read()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = "<malformed>"
            return ("status", resp.status, resp.headers.get("Retry-After"), parsed)
    except aiohttp.ClientError as exc:
        return ("exc", type(exc).__name__)


_EXPECTED = {
    "status": ("status", 500, None, {"error": "injected fault: HTTP 500"}),
    "503": ("status", 503, None, {"error": "injected fault: HTTP 503"}),
    "429": ("status", 429, "2", {"error": "injected fault: too many requests"}),
    "disconnect": ("exc", "ClientPayloadError"),
    "drop": ("exc", "ServerDisconnectedError"),
    "truncated": ("status", 200, None, "<malformed>"),
    "non_object": ("status", 200, None, [{"reward": 1.0}]),
}


@pytest.mark.parametrize(
    ("rate_field", "kind"),
    [
        pytest.param("error_rate", "status", id="error-500"),
        pytest.param("status_429_rate", "429", id="429"),
        pytest.param("disconnect_rate", "disconnect", id="disconnect"),
        pytest.param("drop_rate", "drop", id="drop"),
        pytest.param("malformed_json_rate", "truncated", id="truncated"),
        pytest.param("non_object_rate", "non_object", id="non-object"),
    ],
)
async def test_configured_fault_at_rate_one_hits_every_row(
    session: aiohttp.ClientSession, rate_field: str, kind: str
) -> None:
    async with serve_config(_cfg({rate_field: 1.0, "retry_after_s": 2})) as d:
        outcomes = [await _outcome(session, d.url_of("env") + "/run", _row(task=t)) for t in range(3)]
        stats = d.stats("env")
    assert outcomes == [_EXPECTED[kind]] * 3
    assert stats.faults == {kind: 3}
    assert stats.requests == 3


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        pytest.param("500", "status", id="500"),
        pytest.param("503", "503", id="503"),
        pytest.param("disconnect", "disconnect", id="disconnect"),
        pytest.param("drop", "drop", id="drop"),
        pytest.param("truncated", "truncated", id="truncated"),
        pytest.param("non_object", "non_object", id="non-object"),
    ],
)
async def test_row_fault_field_forces_the_fault(
    session: aiohttp.ClientSession, fault: str, expected: str
) -> None:
    async with serve_config(_cfg()) as d:
        faulted = await _outcome(session, d.url_of("env") + "/run", _row(fault=fault))
        healthy = await _outcome(session, d.url_of("env") + "/run", _row(task=1))
    assert faulted == _EXPECTED[expected]
    assert healthy[:2] == ("status", 200)
    assert healthy[3]["reward"] == 1.0


async def test_row_fault_429_sends_retry_after(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d:
        got = await _outcome(session, d.url_of("env") + "/run", _row(fault="429"))
    assert got == ("status", 429, "1", {"error": "injected fault: too many requests"})


async def test_fault_until_attempt_lets_the_retry_succeed(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d:
        url = d.url_of("env") + "/run"
        first = await _outcome(session, url, _row(fault="503", fault_until_attempt=1))
        retry = await _outcome(session, url, _row(attempt=1, fault="503", fault_until_attempt=1))
        stats = d.stats("env")
    assert first[:2] == ("status", 503)
    assert retry[:2] == ("status", 200)
    assert stats.request_counts == {(0, 0): 2}


async def test_mixed_rates_fail_exactly_the_rows_choose_predicts(session: aiohttp.ClientSession) -> None:
    faults = {"error_status": 502, "error_rate": 0.3, "status_429_rate": 0.2, "seed": 5}
    plan = FaultConfig.from_mapping(faults, key_path="f")
    keys_ = [RolloutKey(t, r, a) for t in range(10) for r in range(2) for a in range(2)]
    predicted = [plan.choose(k) for k in keys_]
    async with serve_config(_cfg(faults)) as d:
        statuses = [
            (await _outcome(session, d.url_of("env") + "/run", _row(k.task, int(k.rollout), k.attempt)))[1]
            for k in keys_
        ]
        stats = d.stats("env")
    expected = [200 if f is None else f.status for f in predicted]
    assert statuses == expected
    counts = Counter(expected)
    assert counts[502] > 0
    assert counts[429] > 0
    assert counts[200] > 0
    assert stats.faults == {k: v for k, v in {"status": counts[502], "429": counts[429]}.items() if v}


@pytest.mark.parametrize(
    ("source", "hang"),
    [pytest.param("config", {"hang_rate": 1.0}, id="config"), pytest.param("row", None, id="row")],
)
async def test_hang_never_answers_until_the_client_leaves(source: str, hang: dict[str, Any] | None) -> None:
    row = _row() if source == "config" else _row(fault="hang")
    async with serve_config(_cfg(hang)) as d, aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(_outcome(s, d.url_of("env") + "/run", row))
        await _wait(d, lambda st: st.in_flight == 1)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait(d, lambda st: st.cancelled == 1)
        stats = d.stats("env")
    assert (stats.in_flight, stats.completed, stats.faults) == (0, 0, {"hang": 1})


async def _wait(d: Deployment, pred: Any) -> None:
    async with asyncio.timeout(20):
        while True:
            if pred(d.stats("env")):
                return
            await asyncio.sleep(0.01)


async def test_episode_rows_take_faults_from_task_input(session: aiohttp.ClientSession) -> None:
    body = {
        "episode_id": {"rollout_id": "0-0", "attempt": 0},
        "task": {"task_id": {"taskset": "t", "task_id": "0"}, "task_input": _row(fault="500")},
    }
    async with serve_config(_cfg()) as d:
        got = await _outcome(session, d.url_of("env") + "/run", body)
    assert got == _EXPECTED["status"]


async def test_aggregate_error_status(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg({"aggregate_error_status": 503})) as d:
        got = await _outcome(session, d.url_of("env") + "/aggregate_metrics", {"verify_responses": []})
        stats = d.stats("env")
    assert got == ("status", 503, None, {"error": "injected fault: /aggregate_metrics HTTP 503"})
    assert stats.aggregate_calls == 1


def test_choose_is_deterministic_and_respects_rates() -> None:
    plan = FaultConfig.from_mapping({"error_rate": 0.3}, key_path="f")
    keys_ = [RolloutKey(t, 0) for t in range(2000)]
    first = [plan.choose(k) for k in keys_]
    assert first == [plan.choose(k) for k in keys_]
    hits = sum(1 for f in first if f is not None)
    assert 500 < hits < 700  # 0.3 of 2000, sha256-uniform
    assert FaultConfig().choose(RolloutKey(0, 0)) is None
    assert set(first) == {None, Fault("status", status=500)}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param([1], "f = [1] is not a mapping", id="not-mapping"),
        pytest.param({"hang_rate": 1.5}, "f.hang_rate = 1.5 is outside [0, 1]", id="rate-range"),
        pytest.param({"error_status": 200}, "f.error_status = 200 is not an HTTP error status", id="status"),
        pytest.param({"retry_after_s": "soon"}, "f.retry_after_s = 'soon' is not a number", id="retry-after"),
        pytest.param({"seed": 1.5}, "f.seed = 1.5 is not an integer", id="seed"),
    ],
)
def test_bad_fault_config_names_the_field(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        FaultConfig.from_mapping(raw, key_path="f")
    assert message in str(info.value)


def test_row_fault_values() -> None:
    assert row_fault({"fault": "503"}, 0, where="row") == Fault("status", status=503)
    assert row_fault({"fault": "hang", "fault_until_attempt": 2}, 1, where="row") == Fault("hang")
    assert row_fault({"fault": "hang", "fault_until_attempt": 2}, 2, where="row") is None
    assert row_fault({}, 0, where="row") is None
    with pytest.raises(InputError, match=r"row 3\.fault = 'boom' is not one of"):
        row_fault({"fault": "boom"}, 0, where="row 3")

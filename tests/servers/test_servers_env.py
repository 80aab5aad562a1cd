"""example_env /run (flat rows and episodes), the policy, stats and disconnect cancellation;
example_resources /verify."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gym_ray import keys
from gym_ray.servers import Deployment, serve_config
from gym_ray.servers.policy import RolloutKey, SimulatedPolicy, extract_answer, row_seed


def _cfg(**fields: Any) -> dict[str, Any]:
    return {
        "env": {"environment_servers": {"example_env": {"port": 0, **fields}}},
        "verifier": {"resources_servers": {"example_resources": {"port": 0}}},
    }


def _row(question: str = "What is 17 + 25?", answer: str = "42", **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question}]},
        "expected_answer": answer,
        "agent_ref": {"name": "agent"},
        **extra,
    }


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _wait_until(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if pred():
                return
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("difficulty", "skill", "reward"),
    [
        pytest.param(0.0, 0.0, 1.0, id="easy"),
        pytest.param(1.0, 0.0, 0.0, id="impossible"),
        pytest.param(1.0, 1.0, 1.0, id="impossible-but-skilled"),
    ],
)
async def test_flat_run_reward_follows_difficulty_and_skill(
    session: aiohttp.ClientSession, difficulty: float, skill: float, reward: float
) -> None:
    async with serve_config(_cfg(skill=skill)) as d:
        status, result = await _post(
            session,
            d.url_of("env") + "/run",
            _row(difficulty=difficulty, _ng_task_index=3, _ng_rollout_index=1),
        )
    assert status == 200
    assert result["reward"] == reward
    assert result["expected_answer"] == "42"
    assert (result["extracted_answer"] == "42") is (reward == 1.0)
    assert result["responses_create_params"] == _row()["responses_create_params"]
    response = result["response"]
    assert response["object"] == "response"
    message = response["output"][0]
    assert (message["type"], message["role"], message["content"][0]["type"]) == (
        "message",
        "assistant",
        "output_text",
    )
    assert message["content"][0]["text"] == f"The answer is {result['extracted_answer']}."
    assert response["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }
    assert not [k for k in result if keys.is_reserved_result_key(k)]
    assert sorted(result) == [
        "expected_answer",
        "extracted_answer",
        "response",
        "responses_create_params",
        "reward",
    ]


async def test_flat_run_without_expected_answer_solves_the_arithmetic(session: aiohttp.ClientSession) -> None:
    row = _row("What is 6 * 7?")
    del row["expected_answer"]
    async with serve_config(_cfg()) as d:
        _, result = await _post(session, d.url_of("env") + "/run", row)
    assert (result["extracted_answer"], result["reward"], result["expected_answer"]) == ("42", 0.0, None)


async def test_episode_run_returns_envelope_with_result(session: aiohttp.ClientSession) -> None:
    body = {
        "episode_id": {"rollout_id": "4-2", "attempt": 1},
        "task": {"task_id": {"taskset": "arith", "task_id": "t4"}, "task_input": _row(difficulty=0.0)},
    }
    async with serve_config(_cfg()) as d:
        status, reply = await _post(session, d.url_of("env") + "/run", body)
        stats = d.stats("env")
    assert status == 200
    assert sorted(reply) == ["episode_id", "result", "task_id"]
    assert reply["episode_id"] == {"rollout_id": "4-2", "attempt": 1}
    assert reply["task_id"] == {"taskset": "arith", "task_id": "t4"}
    assert reply["result"]["reward"] == 1.0
    assert stats.request_counts == {(4, 2): 1}


@pytest.mark.parametrize(
    ("task_input_extra", "failure"),
    [
        pytest.param(
            {"force_failure": True},
            {
                "failure_reason": "forced failure (row field force_failure)",
                "terminal": True,
                "failure_kind": "forced",
                "stage": "agent",
            },
            id="forced-terminal",
        ),
        pytest.param(
            {"force_failure": "sandbox died", "force_failure_terminal": False},
            {"failure_reason": "sandbox died", "terminal": False, "failure_kind": "forced", "stage": "agent"},
            id="forced-retryable",
        ),
    ],
)
async def test_episode_run_forced_failure(
    session: aiohttp.ClientSession, task_input_extra: dict[str, Any], failure: dict[str, Any]
) -> None:
    body = {
        "episode_id": {"rollout_id": "custom.id", "attempt": 0},
        "task": {"task_id": {"taskset": "arith", "task_id": "t9"}, "task_input": _row(**task_input_extra)},
    }
    async with serve_config(_cfg()) as d:
        status, reply = await _post(session, d.url_of("env") + "/run", body)
        stats = d.stats("env")
    assert status == 200
    assert reply == {"episode_id": body["episode_id"], "task_id": body["task"]["task_id"], "failure": failure}
    assert stats.request_counts == {("t9", "custom.id"): 1}


async def test_episode_with_bad_task_input_is_a_terminal_failure(session: aiohttp.ClientSession) -> None:
    body = {
        "episode_id": {"rollout_id": "0-0", "attempt": 0},
        "task": {"task_id": {"taskset": "a", "task_id": "x"}, "task_input": {"question": "?"}},
    }
    async with serve_config(_cfg()) as d:
        _, reply = await _post(session, d.url_of("env") + "/run", body)
    assert reply["failure"]["terminal"] is True
    assert reply["failure"]["stage"] == "admission"
    assert "task.task_input.responses_create_params = None" in reply["failure"]["failure_reason"]


async def test_flat_forced_failure_is_a_handled_failure_result(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d:
        status, result = await _post(session, d.url_of("env") + "/run", _row(force_failure="boom"))
    assert status == 200
    assert result == {
        "_ng_failure_class": "environment_server_failed",
        "_ng_failure_terminal": True,
        "failure_reason": "boom",
        "failure_kind": "forced",
    }
    assert not [k for k in result if keys.is_reserved_result_key(k)]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        pytest.param({"agent_ref": {"name": "a"}}, 422, "row.responses_create_params = None", id="no-params"),
        pytest.param(
            _row(difficulty=2), 422, "row.difficulty = 2 is not a number in [0, 1]", id="difficulty"
        ),
        pytest.param(_row(fault="explode"), 422, "row.fault = 'explode' is not one of", id="fault-value"),
        pytest.param([1, 2], 422, "body is a JSON list", id="list-body"),
        pytest.param(
            {"episode_id": {"attempt": 0}, "task": {}}, 422, "needs a string rollout_id", id="episode-id"
        ),
    ],
)
async def test_bad_run_bodies_get_4xx_naming_the_field(
    session: aiohttp.ClientSession, body: Any, status: int, message: str
) -> None:
    async with serve_config(_cfg()) as d:
        got_status, reply = await _post(session, d.url_of("env") + "/run", body)
    assert got_status == status
    assert message in reply["error"]


async def test_non_json_body_is_400(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d, session.post(d.url_of("env") + "/run", data=b"{nope") as resp:
        assert resp.status == 400
        assert "body is not JSON" in (await resp.json())["error"]


async def test_policy_is_deterministic_per_rollout_and_seed(session: aiohttp.ClientSession) -> None:
    rows = [_row(difficulty=0.5, _ng_task_index=t, _ng_rollout_index=r) for t in range(8) for r in range(4)]
    async with serve_config(_cfg(seed=7)) as d:
        first = [(await _post(session, d.url_of("env") + "/run", row))[1] for row in rows]
        again = [(await _post(session, d.url_of("env") + "/run", row))[1] for row in rows]
    policy = SimulatedPolicy(seed=7)
    expected = [
        policy.answer(
            question="What is 17 + 25?",
            expected_answer="42",
            difficulty=0.5,
            key=RolloutKey(row["_ng_task_index"], row["_ng_rollout_index"]),
        ).answer
        for row in rows
    ]
    assert [r["extracted_answer"] for r in first] == expected
    assert [r["reward"] for r in first] == [r["reward"] for r in again]
    assert [r["response"]["id"] for r in first] == [r["response"]["id"] for r in again]
    rewards = [r["reward"] for r in first]
    assert sorted(set(rewards)) == [0.0, 1.0]


def test_row_seed_and_attempt_change_the_draw() -> None:
    policy = SimulatedPolicy(seed=0)
    kwargs: dict[str, Any] = {"question": "What is 1 + 1?", "expected_answer": "2", "difficulty": 0.5}
    by_seed = {
        s: [policy.answer(key=RolloutKey(t, 0), seed=s, **kwargs).answer for t in range(32)] for s in (1, 2)
    }
    by_attempt = {
        a: [policy.answer(key=RolloutKey(t, 0, a), **kwargs).answer for t in range(32)] for a in (0, 1)
    }
    assert by_seed[1] != by_seed[2]
    assert by_attempt[0] != by_attempt[1]
    assert row_seed({"metadata": {"extra_body": json.dumps({"seed": 11})}}) == 11
    assert row_seed({"metadata": {"extra_body": "not json"}}) is None
    assert row_seed({"input": "x"}) is None
    assert extract_answer("I think the answer is: 17.") == "17"
    assert extract_answer("hmm 3 then 4") == "4"


async def test_set_skill_at_run_time(session: aiohttp.ClientSession) -> None:
    row = _row(difficulty=1.0)
    async with serve_config(_cfg()) as d:
        url = d.url_of("env")
        before = (await _post(session, url + "/run", row))[1]["reward"]
        status, settings = await _post(session, url + "/policy", {"skill": 1.0})
        after = (await _post(session, url + "/run", row))[1]["reward"]
        bad = await _post(session, url + "/policy", {"skill": 3})
        d.set_skill("env", 0.0)
        reset = (await _post(session, url + "/run", row))[1]["reward"]
    assert (before, status, settings["skill"], after, reset) == (0.0, 200, 1.0, 1.0, 0.0)
    assert bad[0] == 422
    assert "skill = 3 is not a number in [0, 1]" in bad[1]["error"]


async def test_latency_mode_still_answers(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg(latency_ms=5, latency_jitter_ms=5)) as d:
        status, result = await _post(session, d.url_of("env") + "/run", _row())
    assert (status, result["reward"]) == (200, 1.0)
    assert SimulatedPolicy(latency_ms=0).latency_s(RolloutKey(0, 0)) == 0.0
    assert 0.005 <= SimulatedPolicy(latency_ms=5, latency_jitter_ms=5).latency_s(RolloutKey(0, 0)) < 0.010


async def test_stats_count_requests_per_rollout(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d:
        url = d.url_of("env")
        for t, r in [(0, 0), (0, 1), (0, 1), (2, 0)]:
            await _post(session, url + "/run", _row(_ng_task_index=t, _ng_rollout_index=r))
        await _post(session, url + "/aggregate_metrics", {"verify_responses": []})
        stats = d.stats("env")
        _, stats_json = await _get_json(session, url + "/_stats")
        d.reset_stats()
        after_reset = d.stats("env")
    assert (stats.requests, stats.completed, stats.in_flight, stats.max_in_flight) == (4, 4, 0, 1)
    assert (stats.cancelled, stats.aggregate_calls) == (0, 1)
    assert stats.request_counts == {(0, 0): 1, (0, 1): 2, (2, 0): 1}
    assert stats_json["request_counts"] == {"0-0": 1, "0-1": 2, "2-0": 1}
    assert stats_json["requests"] == 4
    assert (after_reset.requests, after_reset.request_counts, after_reset.max_in_flight) == (0, {}, 0)


async def _get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def _hang_requests(d: Deployment, n: int) -> None:
    """Start n hanging /run requests, wait until all are in flight, then disconnect them."""
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.ensure_future(_post(s, d.url_of("env") + "/run", _row(fault="hang", _ng_task_index=i)))
            for i in range(n)
        ]
        try:
            await _wait_until(lambda: d.stats("env").in_flight == n)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("n", [pytest.param(1, id="one"), pytest.param(3, id="three")])
async def test_client_disconnect_cancels_the_handler(n: int) -> None:
    async with serve_config(_cfg()) as d:
        await _hang_requests(d, n)
        await _wait_until(lambda: d.stats("env").cancelled == n)
        stats = d.stats("env")
    assert (stats.requests, stats.cancelled, stats.in_flight, stats.max_in_flight, stats.completed) == (
        n,
        n,
        0,
        n,
        0,
    )
    assert stats.faults == {"hang": n}


async def test_resources_verify_and_seed_session(session: aiohttp.ClientSession) -> None:
    async with serve_config(_cfg()) as d:
        url = d.url_of("verifier")
        _, run = await _post(session, d.url_of("env") + "/run", _row(difficulty=1.0))
        _, wrong = await _post(session, url + "/verify", {**_row(), "response": run["response"]})
        _, right = await _post(
            session, url + "/verify", {**_row(answer=run["extracted_answer"]), "response": run["response"]}
        )
        _, empty = await _post(session, url + "/verify", _row())
        seeded = await _post(session, url + "/seed_session", _row())
        stats = d.stats("verifier")
    assert (wrong["reward"], right["reward"], empty["reward"]) == (0.0, 1.0, 0.0)
    assert wrong["extracted_answer"] == run["extracted_answer"]
    assert empty["extracted_answer"] is None
    assert right["expected_answer"] == run["extracted_answer"]
    assert seeded == (200, {})
    assert stats.verify_calls == 3


@pytest.fixture
async def model_url() -> AsyncIterator[str]:
    """A tiny real Responses API model: answers 42 to 'What is 17 + 25?', HTTP 500 to anything else."""
    from aiohttp import web

    from gym_ray.servers import _web

    async def responses(request: web.Request) -> web.Response:
        body = await request.json()
        if body["input"][0]["content"] != "What is 17 + 25?":
            return web.json_response({"error": "model overloaded"}, status=500)
        return web.json_response(
            {
                "id": "resp_model",
                "model": body.get("model"),
                "output": [{"type": "message", "content": [{"type": "output_text", "text": "It is 42"}]}],
                "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    runner = _web.make_runner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{_web.bound_port(runner)}/v1"
    finally:
        await runner.cleanup()


async def test_real_policy_model_answers(session: aiohttp.ClientSession, model_url: str) -> None:
    async with serve_config(_cfg(policy_base_url=model_url, policy_model="m1")) as d:
        status, result = await _post(session, d.url_of("env") + "/run", _row())
    assert (status, result["reward"], result["extracted_answer"]) == (200, 1.0, "42")
    assert result["response"]["id"] == "resp_model"
    assert result["response"]["model"] == "m1"


async def test_real_policy_model_errors(session: aiohttp.ClientSession, model_url: str) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    episode = {
        "episode_id": {"rollout_id": "0-0", "attempt": 0},
        "task": {"task_id": {"taskset": "a", "task_id": "0"}, "task_input": _row()},
    }
    async with serve_config(_cfg(policy_base_url=dead_url)) as d:
        flat_status, flat = await _post(session, d.url_of("env") + "/run", _row())
        _, ep = await _post(session, d.url_of("env") + "/run", episode)
    async with serve_config(_cfg(policy_base_url=model_url)) as d:
        http_status, http = await _post(session, d.url_of("env") + "/run", _row("What is 1 + 1?"))
    assert flat_status == 502
    assert f"policy model at {dead_url}/responses did not answer" in flat["error"]
    assert (ep["failure"]["terminal"], ep["failure"]["failure_kind"], ep["failure"]["stage"]) == (
        False,
        "policy_model_error",
        "agent",
    )
    assert http_status == 502
    assert "answered HTTP 500" in http["error"]

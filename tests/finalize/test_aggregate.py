"""Tests for gym_ray.finalize.aggregate: labels, stripping, the metrics file, failures, completion
rejection."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import (
    AggregationError,
    InputError,
    RunRejectedError,
    ServerHTTPError,
    UsageError,
    ValidationError,
)
from gym_ray.finalize._aggregate_spool import STOP_CHECK_ROWS
from gym_ray.finalize.aggregate import (
    AggregateEntry,
    _file_shape,
    aggregate_metrics,
    aggregate_run,
    completion_rejection,
    label_runs,
    raise_for_aggregation_errors,
    raise_for_completion_rejection,
    strip_for_aggregation,
)
from gym_ray.servers import compute_aggregate_metrics, serve_config

# --- labels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agents_by_server", "expected"),
    [
        pytest.param(
            {"env_a": "ag1", "env_b": "ag1", "env_c": "ag2", "env_multi": None},
            {"env_a": "env_a", "env_b": "env_b", "env_c": "ag2", "env_multi": "env_multi"},
            id="verified-nemo-gym-example",
        ),
        pytest.param({"env1": "ag1"}, {"env1": "ag1"}, id="one-server-one-agent"),
        pytest.param({"env1": None}, {"env1": "env1"}, id="no-agent"),
        pytest.param(
            {"env_a": "env_b", "env_b": None},
            {"env_a": "env_a", "env_b": "env_b"},
            id="agent-name-clashes-with-other-server-name",
        ),
        pytest.param(
            {"env_a": "env_b", "env_b": "ag9"},
            {"env_a": "env_b", "env_b": "ag9"},
            id="no-clash-when-other-server-is-labelled-by-its-agent",
        ),
        pytest.param(
            {"x": "y", "y": "z", "z": None},
            {"x": "x", "y": "y", "z": "z"},
            id="clash-cascades",
        ),
    ],
)
def test_label_runs(agents_by_server: dict[str, str | None], expected: dict[str, str]) -> None:
    assert label_runs(agents_by_server) == expected


# --- stripping --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        pytest.param(
            {
                "reward": 1.0,
                "response": {"id": "r", "output": [1, 2], "usage": {"total_tokens": 3}},
                "responses_create_params": {"input": "x"},
                "ng_trajectory": {"t": 1},
                "ng_model_call_capture": [1],
                "ng_agent_observations": [2],
                "ng_perf": {"wall_ms": 5},
                "_ng_task_index": 2,
                "extra": "kept",
            },
            {
                "reward": 1.0,
                "response": {"usage": {"total_tokens": 3}},
                "ng_perf": {"wall_ms": 5},
                "_ng_task_index": 2,
                "extra": "kept",
            },
            id="heavy-fields-dropped-usage-kept",
        ),
        pytest.param(
            {"reward": 0.0, "response": {"incomplete_details": {"reason": "max"}, "usage": None}},
            {"reward": 0.0, "response": {"incomplete_details": {"reason": "max"}}},
            id="incomplete-details-kept-null-usage-dropped",
        ),
        pytest.param(
            {"reward": 0.5, "response": {"output": []}},
            {"reward": 0.5},
            id="no-usage-no-response",
        ),
        pytest.param({"reward": 0.5}, {"reward": 0.5}, id="nothing-to-strip"),
    ],
)
def test_strip_for_aggregation(result: dict[str, object], expected: dict[str, object]) -> None:
    before = repr(result)
    assert strip_for_aggregation(result) == expected
    assert repr(result) == before  # input untouched


# --- completion rejection ------------------------------------------------------------------------------

_RESUME = (
    "RUN REJECTED: 3/4 rollouts completed; 1 unfinished rollout(s) can still be retried, so no score "
    "is published yet. Resume the run (run the same config with the same run folder) to finish "
    "them; only the unfinished rollouts run again"
)
_NO_PROGRESS = (
    "RUN REJECTED: 3/4 rollouts completed; 1 unfinished rollout(s) can still be retried, but this attempt "
    "saved no outcome that made progress, so another attempt as-is would not help. Inspect the "
    "failures (`gym-ray status RUN_DIR`) and the environment servers, fix the cause, then resume"
)
_NOTHING = (
    "RUN REJECTED: 0/4 rollouts completed; none of the 4 planned rollouts completed and none can be "
    "retried, so no score is published. Inspect the failures sidecars (`gym-ray status RUN_DIR`), "
    "fix the servers or inputs, then start a fresh run"
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"completed": 3, "can_retry": True, "made_progress": True, "strict": False},
            None,
            id="not-strict",
        ),
        pytest.param(
            {"completed": 4, "can_retry": False, "made_progress": True, "strict": True},
            None,
            id="complete",
        ),
        pytest.param(
            {"completed": 3, "final_zero_rows": 1, "can_retry": True, "made_progress": True, "strict": True},
            None,
            id="final-zero-rows-complete-the-run",
        ),
        pytest.param(
            {"completed": 3, "can_retry": False, "made_progress": True, "strict": True},
            None,
            id="omissions-alongside-completed-allowed",
        ),
        pytest.param(
            {"completed": 3, "can_retry": False, "made_progress": False, "strict": True},
            None,
            id="omissions-allowed-without-progress",
        ),
        pytest.param(
            {"completed": 3, "can_retry": True, "made_progress": True, "strict": True},
            _RESUME,
            id="retryable-with-progress-resume",
        ),
        pytest.param(
            {"completed": 3, "can_retry": True, "made_progress": False, "strict": True},
            _NO_PROGRESS,
            id="retryable-without-progress",
        ),
        pytest.param(
            {"completed": 0, "can_retry": False, "made_progress": False, "strict": True},
            _NOTHING,
            id="nothing-completed-nothing-retryable",
        ),
        pytest.param(
            {"completed": 2, "final_zero_rows": 1, "can_retry": True, "made_progress": True, "strict": True},
            "RUN REJECTED: 3/4 rollouts completed (1 of them failures scored as zero); 1 unfinished "
            "rollout(s) can still be retried, so no score is published yet. Resume the run (run the same "
            "config with the same run folder) to finish them; only the unfinished rollouts run again",
            id="zero-rows-named-in-message",
        ),
    ],
)
def test_completion_rejection_truth_table(kwargs: dict[str, object], message: str | None) -> None:
    rejection = completion_rejection(expected=4, **kwargs)  # type: ignore[arg-type]
    if message is None:
        assert rejection is None
        raise_for_completion_rejection(expected=4, **kwargs)  # type: ignore[arg-type]
        return
    assert isinstance(rejection, RunRejectedError)
    assert str(rejection) == message
    with pytest.raises(RunRejectedError) as info:
        raise_for_completion_rejection(expected=4, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_completion_rejection_empty_plan_is_complete() -> None:
    assert (
        completion_rejection(expected=0, completed=0, can_retry=False, made_progress=False, strict=True)
        is None
    )


def test_completion_rejection_refuses_negative_counts() -> None:
    with pytest.raises(
        UsageError, match=r"counts must be >= 0, got expected=4, completed=-1, final_zero_rows=0"
    ):
        completion_rejection(expected=4, completed=-1, can_retry=True, made_progress=True, strict=True)


# --- the metrics file, against real servers --------------------------------------------------------------

_HOST = "127.0.0.1"


def _agent(name: str) -> dict[str, Any]:
    return {"responses_api_agents": {"example_env": {"host": _HOST, "port": 0}}}


def _ref(agent: str) -> dict[str, str]:
    return {"type": "responses_api_agents", "name": agent}


def _env(fields: dict[str, Any], implementation: str = "example_env") -> dict[str, Any]:
    return {"environment_servers": {implementation: {"host": _HOST, "port": 0, **fields}}}


def _base_config() -> dict[str, Any]:
    return {
        "head_server": {"host": _HOST, "port": 0},
        "ag1": _agent("ag1"),
        "ag2": _agent("ag2"),
        "ag3": _agent("ag3"),
        "ag4": _agent("ag4"),
        "env_c": _env({"agent_server": _ref("ag2")}),
        "env_b": _env({"agent_server": _ref("ag1")}),
        "env_a": _env({"agent_server": _ref("ag1")}),
        "env_multi": _env({"first": _ref("ag3"), "second": _ref("ag4")}),
    }


def _result(
    task: int, rollout: int, reward: float, *, agent: str | None, server: str | None, **extra: Any
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "reward": reward,
        "response": {
            "id": f"resp-{task}-{rollout}",
            "output": [{"type": "message", "content": "x" * 50}],
            "usage": {"input_tokens": 10 + task, "output_tokens": 5, "total_tokens": 15 + task},
        },
        "responses_create_params": {"input": [{"role": "user", "content": "question"}]},
        "ng_trajectory": {"steps": [1, 2, 3]},
        "ng_model_call_capture": [{"request": "big"}],
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        **extra,
    }
    if agent is not None:
        row["agent_ref"] = {"name": agent}
    if server is not None:
        row["_ng_environment_server"] = server
    return row


def _label_example_results() -> list[dict[str, Any]]:
    """Results for the verified label_runs example; deliberately not in (task, rollout) order."""
    return [
        _result(0, 1, 0.0, agent="ag1", server="env_a"),
        _result(3, 0, 1.0, agent=None, server="env_multi"),
        _result(1, 0, 1.0, agent="ag1", server="env_b"),
        _result(0, 0, 1.0, agent="ag1", server="env_a"),
        _result(2, 0, 1.0, agent="ag2", server=None),  # no stamp: the front of ag2 is env_c
        {
            "_ng_failure_class": "agent_run_error",
            "_ng_task_index": 9,
            "_ng_rollout_index": 0,
            "agent_ref": {"name": "ag1"},
            "_ng_environment_server": "env_a",
        },
        {
            "_ng_failure_class": "cancelled",
            "_ng_no_persist": True,
            "_ng_dispatch_drained": True,
            "_ng_task_index": 8,
            "_ng_rollout_index": 0,
            "_ng_environment_server": "env_b",
        },
    ]


def _expected_body(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        (strip_for_aggregation(r) for r in results),
        key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]),
    )


@contextlib.asynccontextmanager
async def _deployment(cfg: dict[str, Any]) -> AsyncIterator[tuple[Any, Topology, ServerClient]]:
    async with serve_config(cfg) as deployment:
        topology = Topology.from_config(deployment.config)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            yield deployment, topology, client


async def test_aggregate_file_shape_labels_and_order(tmp_path: Path) -> None:
    results = _label_example_results()
    output = tmp_path / "out" / "rollouts_aggregate_metrics.json"
    async with _deployment(_base_config()) as (deployment, topology, client):
        path = await aggregate_metrics(iter(results), topology, client, output_path=output)
        calls = {name: deployment.stats(name).aggregate_calls for name in topology.environment_servers()}
    assert path == output
    assert calls == {"env_c": 1, "env_b": 1, "env_a": 1, "env_multi": 1}
    written = json.loads(output.read_text(encoding="utf-8"))
    groups = {
        "env_a": [results[3], results[0]],
        "env_b": [results[2]],
        "env_c": [results[4]],
        "env_multi": [results[1]],
    }
    labels = {"env_a": "env_a", "env_b": "env_b", "env_c": "ag2", "env_multi": "env_multi"}
    expected = []
    for server in ["env_a", "env_b", "env_c", "env_multi"]:
        metrics = compute_aggregate_metrics(_expected_body(groups[server]))
        entry = {
            "agent_ref": {"name": labels[server]},
            "_ng_environment_server": server,
            "agent_metrics": metrics["agent_metrics"],
            "key_metrics": metrics["key_metrics"],
            "group_level_metrics": metrics["group_level_metrics"],
        }
        for optional in ("repeat_level_metrics", "perf_summary"):
            if metrics.get(optional) is not None:
                entry[optional] = metrics[optional]
        expected.append(entry)
    assert written == expected
    assert list(written[0])[:5] == [
        "agent_ref",
        "_ng_environment_server",
        "agent_metrics",
        "key_metrics",
        "group_level_metrics",
    ]
    # no newline at the end, as NeMo Gym 0.7 writes it
    assert output.read_text(encoding="utf-8") == json.dumps(expected, indent=2, ensure_ascii=False)
    assert [p.name for p in output.parent.iterdir()] == [output.name]  # no temp file left behind


class _Recorder:
    """A tiny /aggregate_metrics server that records every body it receives."""

    def __init__(self, reply: Callable[[list[dict[str, Any]]], Any] = compute_aggregate_metrics) -> None:
        self.bodies: list[Any] = []
        self.raw: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.entered = asyncio.Event()
        self.release: asyncio.Event | None = None
        self._reply = reply

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.raw.append(raw)
        self.headers.append(dict(request.headers))
        body = json.loads(raw)
        self.bodies.append(body)
        self.entered.set()
        if self.release is not None:
            await self.release.wait()
        return web.json_response(self._reply(body["verify_responses"]))

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        app = web.Application()
        app.router.add_post("/aggregate_metrics", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, _HOST, 0).start()
            yield int(runner.addresses[0][1])
        finally:
            await runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


async def test_request_bodies_are_stripped_and_sorted(tmp_path: Path) -> None:
    recorder = _Recorder()
    results = [
        _result(1, 0, 0.0, agent="ag1", server=None, ng_perf={"wall_ms": 7}, ng_agent_observations=[1]),
        _result(0, 1, 1.0, agent="ag1", server="env_rec", extra_field="kept"),
        {
            "reward": 0.5,
            "response": {"output": [], "incomplete_details": {"reason": "max_output_tokens"}},
            "_ng_task_index": 0,
            "_ng_rollout_index": 0,
            "agent_ref": {"name": "ag1"},
        },
    ]
    async with recorder.serving() as port:
        cfg = {
            "ag1": _agent("ag1"),
            "env_rec": {
                "environment_servers": {
                    "recorder": {"host": _HOST, "port": port, "agent_server": _ref("ag1")}
                }
            },
        }
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            path = await aggregate_metrics(results, topology, client, output_path=tmp_path / "m.json")
    assert path == tmp_path / "m.json"
    assert recorder.bodies == [
        {
            "verify_responses": [
                {
                    "reward": 0.5,
                    "response": {"incomplete_details": {"reason": "max_output_tokens"}},
                    "_ng_task_index": 0,
                    "_ng_rollout_index": 0,
                    "agent_ref": {"name": "ag1"},
                },
                {
                    "reward": 1.0,
                    "response": {"usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}},
                    "_ng_task_index": 0,
                    "_ng_rollout_index": 1,
                    "extra_field": "kept",
                    "agent_ref": {"name": "ag1"},
                    "_ng_environment_server": "env_rec",
                },
                {
                    "reward": 0.0,
                    "response": {"usage": {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16}},
                    "_ng_task_index": 1,
                    "_ng_rollout_index": 0,
                    "ng_perf": {"wall_ms": 7},
                    "agent_ref": {"name": "ag1"},
                },
            ]
        }
    ]
    entry = json.loads(path.read_text(encoding="utf-8"))[0]
    assert entry["agent_ref"] == {"name": "ag1"}
    assert entry["_ng_environment_server"] == "env_rec"


def _failing_config() -> dict[str, Any]:
    cfg = _base_config()
    cfg["env_b"] = _env({"agent_server": _ref("ag1"), "faults": {"aggregate_error_status": 500}})
    cfg["env_down"] = _env({"agent_server": _ref("ag3"), "port": _closed_port()}, implementation="external")
    return cfg


def _failing_results() -> list[dict[str, Any]]:
    return [*_label_example_results(), _result(4, 0, 1.0, agent=None, server="env_down")]


async def test_failed_servers_keep_an_error_entry(tmp_path: Path) -> None:
    output = tmp_path / "rollouts_aggregate_metrics.json"
    async with _deployment(_failing_config()) as (deployment, topology, client):
        path = await aggregate_metrics(
            _failing_results(), topology, client, output_path=output, raise_on_error=False
        )
        assert deployment.stats("env_b").aggregate_calls == 1
    assert path == output
    written = json.loads(output.read_text(encoding="utf-8"))
    assert [e["_ng_environment_server"] for e in written] == [
        "env_a",
        "env_b",
        "env_c",
        "env_down",
        "env_multi",
    ]
    assert [e["agent_ref"]["name"] for e in written] == ["env_a", "env_b", "ag2", "ag3", "env_multi"]
    failed = {e["_ng_environment_server"]: e for e in written if "aggregation_error" in e}
    assert sorted(failed) == ["env_b", "env_down"]
    for entry in failed.values():
        assert {k: entry[k] for k in ("agent_metrics", "key_metrics", "group_level_metrics")} == {
            "agent_metrics": {},
            "key_metrics": {},
            "group_level_metrics": [],
        }
        assert "repeat_level_metrics" not in entry
    assert failed["env_b"]["aggregation_error"].startswith("ServerHTTPError: ")
    assert "500" in failed["env_b"]["aggregation_error"]
    assert failed["env_down"]["aggregation_error"].startswith("ServerConnectionError: ")
    assert written[0]["key_metrics"] == {
        "mean/reward": 0.5,
        "mean/input_tokens": 10.0,
        "mean/output_tokens": 5.0,
        "mean/total_tokens": 15.0,
    }

    for source in (output, str(output), written):
        with pytest.raises(AggregationError) as info:
            raise_for_aggregation_errors(source)
        assert info.value.servers == {
            "env_b": failed["env_b"]["aggregation_error"],
            "env_down": failed["env_down"]["aggregation_error"],
        }
        assert str(info.value) == (
            "/aggregate_metrics failed on 2 environment server(s): "
            f"env_b: {failed['env_b']['aggregation_error']}; "
            f"env_down: {failed['env_down']['aggregation_error']}. The metrics of the other servers are "
            "saved; fix the server(s) and run `gym-ray aggregate RUN_DIR CONFIG` again"
        )
    raise_for_aggregation_errors([e for e in written if "aggregation_error" not in e])


async def test_raise_on_error_reraises_the_original_exception_after_saving(tmp_path: Path) -> None:
    output = tmp_path / "rollouts_aggregate_metrics.json"
    async with _deployment(_failing_config()) as (_, topology, client):
        with pytest.raises(ServerHTTPError) as info:
            await aggregate_metrics(_failing_results(), topology, client, output_path=output)
    exc = info.value
    assert exc.status == 500
    written = json.loads(output.read_text(encoding="utf-8"))
    errors = {e["_ng_environment_server"]: e.get("aggregation_error") for e in written}
    # The first failed server in name order is env_b; its entry holds the very exception raised.
    assert errors["env_b"] == f"ServerHTTPError: {exc}"
    assert errors["env_down"] is not None
    assert errors["env_down"].startswith("ServerConnectionError: ")
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc.__traceback__)]
    assert any(name.endswith("gym_ray/dispatch/client.py") for name in frames)


async def test_reply_of_the_wrong_shape_is_an_aggregation_error(tmp_path: Path) -> None:
    recorder = _Recorder(reply=lambda _: {"agent_metrics": {}, "group_level_metrics": {"x": 1}})
    async with recorder.serving() as port:
        cfg = {"env_rec": {"environment_servers": {"recorder": {"host": _HOST, "port": port}}}}
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            rows = [_result(0, 0, 1.0, agent=None, server="env_rec")]
            path = await aggregate_metrics(
                rows, topology, client, output_path=tmp_path / "m.json", raise_on_error=False
            )
    assert path is not None
    assert json.loads(path.read_text(encoding="utf-8")) == [
        {
            "agent_ref": {"name": "env_rec"},
            "_ng_environment_server": "env_rec",
            "agent_metrics": {},
            "key_metrics": {},
            "group_level_metrics": [],
            "aggregation_error": "ServerResponseError: /aggregate_metrics on 'env_rec' answered a body that "
            "is not AggregateMetrics (group_level_metrics: Input should be a valid list; key_metrics: Field "
            "required); the server must answer group_level_metrics (list), agent_metrics (object) and "
            "key_metrics (object)",
        }
    ]


@pytest.mark.parametrize(
    "results",
    [
        pytest.param([], id="no-results"),
        pytest.param(_label_example_results()[5:], id="only-failures-and-drained"),
    ],
)
async def test_nothing_to_aggregate_writes_no_file(tmp_path: Path, results: list[dict[str, Any]]) -> None:
    async with _deployment(_base_config()) as (deployment, topology, client):
        path = await aggregate_metrics(results, topology, client, output_path=tmp_path / "m.json")
        assert deployment.stats("env_a").aggregate_calls == 0
    assert path is None
    assert os.listdir(tmp_path) == []


async def test_unknown_stamp_is_refused_before_any_request(tmp_path: Path) -> None:
    results = [
        _result(0, 0, 1.0, agent="ag1", server="env_a"),
        _result(0, 1, 1.0, agent="ag1", server="env_gone"),
        _result(1, 0, 1.0, agent="ag1", server="env_gone"),
    ]
    async with _deployment(_base_config()) as (deployment, topology, client):
        with pytest.raises(ValidationError) as info:
            await aggregate_metrics(results, topology, client, output_path=tmp_path / "m.json")
        assert deployment.stats("env_a").aggregate_calls == 0
    assert str(info.value) == (
        "Result rows are stamped with environment server 'env_gone', which is not in the running config "
        "(available: ['env_a', 'env_b', 'env_c', 'env_multi']); aggregate with the config that produced "
        "them ('env_gone' first at result #1 (task 0, rollout 1))"
    )
    assert info.value.problems == ["result #1 (task 0, rollout 1): _ng_environment_server='env_gone'"]
    assert os.listdir(tmp_path) == []


async def test_unattributable_rows_are_listed(tmp_path: Path) -> None:
    results = [
        _result(0, 0, 1.0, agent="ag1", server=None),  # ag1 is fronted by env_a and env_b
        _result(1, 0, 1.0, agent=None, server=None),
    ]
    async with _deployment(_base_config()) as (_, topology, client):
        with pytest.raises(ValidationError) as info:
            await aggregate_metrics(results, topology, client, output_path=tmp_path / "m.json")
    assert str(info.value).startswith(
        "2 result row(s) have no _ng_environment_server stamp and cannot be attributed to an environment "
        "server; aggregate results recorded by gym_ray (they carry the stamp), or give the rows "
        "agent_ref.name: result #0 (task 0, rollout 0): agent 'ag1' is fronted by several environment "
        "servers: "
    )
    assert [p.split(":")[0] for p in info.value.problems] == [
        "result #0 (task 0, rollout 0)",
        "result #1 (task 1, rollout 0)",
    ]


def _write_shard(run_dir: Path, shard: str, successes: list[dict[str, Any]]) -> None:
    keys = ("_ng_task_index", "_ng_rollout_index")
    inputs = "".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in successes)
    (run_dir / f"rollouts-{shard}_materialized_inputs.jsonl").write_text(inputs)
    (run_dir / f"rollouts-{shard}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in successes))


async def test_aggregate_run_merges_missing_output_then_aggregates(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_shard(run_dir, "s1", [_result(1, 0, 1.0, agent="ag2", server="env_c")])
    _write_shard(
        run_dir,
        "s0",
        [_result(0, 1, 0.0, agent="ag1", server="env_a"), _result(0, 0, 1.0, agent="ag1", server="env_a")],
    )
    async with _deployment(_base_config()) as (_, topology, client):
        path = await aggregate_run(run_dir, topology, client)
    assert path == run_dir / "rollouts_aggregate_metrics.json"
    merged = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in merged] == [(0, 0), (0, 1), (1, 0)]
    written = json.loads(path.read_text(encoding="utf-8"))
    assert [(e["agent_ref"], e["_ng_environment_server"]) for e in written] == [
        ({"name": "ag1"}, "env_a"),
        ({"name": "ag2"}, "env_c"),
    ]
    assert [e["key_metrics"]["mean/reward"] for e in written] == [0.5, 1.0]


async def test_aggregate_run_without_successes_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_shard(run_dir, "s0", [])
    async with _deployment(_base_config()) as (_, topology, client):
        assert await aggregate_run(run_dir, topology, client) is None
        with pytest.raises(UsageError, match="does not exist; pass the folder a run wrote"):
            await aggregate_run(tmp_path / "absent", topology, client)
    assert sorted(os.listdir(run_dir)) == [
        "rollouts-s0.jsonl",
        "rollouts-s0_materialized_inputs.jsonl",
        "rollouts.jsonl",
        "rollouts_failures.jsonl",
    ]


# --- golden metrics file: the bytes must not change when the implementation does -------------------------


def _golden_reply(server: str) -> Callable[[list[dict[str, Any]]], Any]:
    """A deterministic reply that depends on the order of the body, with awkward JSON values."""

    def reply(verify_responses: list[dict[str, Any]]) -> dict[str, Any]:
        order = [[r["_ng_task_index"], r["_ng_rollout_index"]] for r in verify_responses]
        tasks = sorted({r["_ng_task_index"] for r in verify_responses})
        rewards = [r["reward"] for r in verify_responses]
        body: dict[str, Any] = {
            "group_level_metrics": [
                {
                    "task_index": t,
                    "mean/reward": sum(r["reward"] for r in verify_responses if r["_ng_task_index"] == t) / 2,
                    "label": f"tâche {t} ✓",
                    "none": None,
                }
                for t in tasks
            ],
            "agent_metrics": {
                "mean/reward": sum(rewards) / len(rewards),
                "third": 1 / 3,
                "tiny": 1e-7,
                "huge": 1e21,
                "negative_zero": -0.0,
                "big_int": 2**70,
                "nested": {"empty_list": [], "empty_dict": {}, "list": [1, 2.5, "x", None, True]},
                "order": order,
            },
            "key_metrics": {
                "mean/reward": sum(rewards) / len(rewards),
                "server": server,
                "quote": 'a"b\\c\n',
            },
            "ignored_extra": {"dropped": True},
        }
        if server == "env_x":
            body["repeat_level_metrics"] = [{"repeat": 0, "score": 0.25}, {"repeat": 1, "score": 0.75}]
            body["perf_summary"] = None
        else:
            body["perf_summary"] = {"p50_ms": 12.5, "unit": "ms"}
        return body

    return reply


def _golden_results() -> list[dict[str, Any]]:
    """50 results over 2 servers: env_x's arrive sorted, env_y's shuffled (deterministically)."""
    env_x = [
        _result(t, r, float((t + r) % 3 == 0), agent="ag1", server="env_x", note=f"ü{t}")
        for t in range(0, 13)
        for r in range(2)
    ]
    env_y = [
        _result(t, r, float((t * r) % 2), agent=None, server="env_y", ng_perf={"wall_ms": t * 10 + r})
        for t in range(13, 25)
        for r in range(2)
    ]
    shuffled = env_y[1::2][::-1] + env_y[0::2]
    merged: list[dict[str, Any]] = []
    for i in range(max(len(env_x), len(shuffled))):
        merged.extend(env_x[i : i + 1])
        merged.extend(shuffled[i : i + 1])
    return merged


# Captured from the implementation that built the whole file as one string (json.dumps, indent=2).
_GOLDEN_SHA256 = "e5d1c18d467b47d4b032f521f39d4681e9fbd267b555b32067c1136ab4459e42"
_GOLDEN_SIZE = 7009


async def test_metrics_file_bytes_match_the_golden(tmp_path: Path) -> None:
    rec_x, rec_y = _Recorder(_golden_reply("env_x")), _Recorder(_golden_reply("env_y"))
    async with rec_x.serving() as port_x, rec_y.serving() as port_y:
        cfg = {
            "ag1": _agent("ag1"),
            "env_x": {
                "environment_servers": {
                    "recorder": {"host": _HOST, "port": port_x, "agent_server": _ref("ag1")}
                }
            },
            "env_y": {"environment_servers": {"recorder": {"host": _HOST, "port": port_y}}},
        }
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            path = await aggregate_metrics(
                iter(_golden_results()), topology, client, output_path=tmp_path / "m.json"
            )
    assert path is not None
    data = path.read_bytes()
    # The golden ended with a newline; NeMo Gym 0.7's metrics file (and now this one) has none.
    assert not data.endswith(b"\n")
    assert hashlib.sha256(data + b"\n").hexdigest() == _GOLDEN_SHA256
    assert len(data) == _GOLDEN_SIZE - 1
    assert os.listdir(tmp_path) == ["m.json"]  # the spool folder is gone


async def test_request_bodies_are_the_bytes_post_json_would_send(tmp_path: Path) -> None:
    # env_x's results arrive sorted (streamed from the spool), env_y's shuffled (sorted in memory).
    rec_x, rec_y = _Recorder(_golden_reply("env_x")), _Recorder(_golden_reply("env_y"))
    results = _golden_results()
    async with rec_x.serving() as port_x, rec_y.serving() as port_y:
        cfg = {
            "ag1": _agent("ag1"),
            "env_x": {
                "environment_servers": {
                    "recorder": {"host": _HOST, "port": port_x, "agent_server": _ref("ag1")}
                }
            },
            "env_y": {"environment_servers": {"recorder": {"host": _HOST, "port": port_y}}},
        }
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            await aggregate_metrics(iter(results), topology, client, output_path=tmp_path / "m.json")
    for recorder, server in ((rec_x, "env_x"), (rec_y, "env_y")):
        expected = {
            "verify_responses": _expected_body([r for r in results if r["_ng_environment_server"] == server])
        }
        assert len(recorder.raw) == 1
        assert recorder.raw[0] == json.dumps(expected, separators=(",", ":")).encode()
        assert recorder.bodies == [expected]
        assert recorder.headers[0]["Content-Length"] == str(len(recorder.raw[0]))
        assert recorder.headers[0]["Content-Type"] == "application/json"
        assert "Transfer-Encoding" not in recorder.headers[0]
    assert [r["_ng_task_index"] for r in rec_y.bodies[0]["verify_responses"]][:4] == [13, 13, 14, 14]


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(
            AggregateEntry(
                agent_ref={"name": "ag"},
                environment_server="env",
                agent_metrics={"a": None, "b": [1, None]},
                key_metrics={"k": 1.5},
                group_level_metrics=[{"g": 1}],
                repeat_level_metrics=[{"r": 2}],
                perf_summary={"p": None},
            ),
            id="every-field",
        ),
        pytest.param(
            AggregateEntry(agent_ref={"name": "ag"}, environment_server="env", key_metrics={"k": 1}),
            id="optional-fields-absent",
        ),
        pytest.param(
            AggregateEntry(agent_ref={"name": "env"}, environment_server="env", aggregation_error="X: y"),
            id="error-entry",
        ),
    ],
)
def test_file_shape_is_to_json_without_copies(entry: AggregateEntry) -> None:
    shape = _file_shape(entry)
    assert shape == entry.to_json()
    assert list(shape) == list(entry.to_json())
    assert shape["key_metrics"] is entry.key_metrics  # shared, not copied


async def test_unserialisable_result_fails_only_its_server(tmp_path: Path) -> None:
    rec_x, rec_y = _Recorder(), _Recorder()
    results = [
        _result(0, 0, 1.0, agent="ag1", server="env_x"),
        _result(1, 0, 0.0, agent=None, server="env_y"),
        _result(2, 0, 1.0, agent=None, server="env_y", extra={1, 2}),
        _result(3, 0, 1.0, agent=None, server="env_y"),
    ]
    async with rec_x.serving() as port_x, rec_y.serving() as port_y:
        cfg = {
            "ag1": _agent("ag1"),
            "env_x": {
                "environment_servers": {
                    "recorder": {"host": _HOST, "port": port_x, "agent_server": _ref("ag1")}
                }
            },
            "env_y": {"environment_servers": {"recorder": {"host": _HOST, "port": port_y}}},
        }
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            with pytest.raises(InputError) as info:
                await aggregate_metrics(results, topology, client, output_path=tmp_path / "m.json")
    message = (
        "result #2 (task 2, rollout 0) cannot be sent to /aggregate_metrics of 'env_y': it is not "
        "JSON-serialisable (Object of type set is not JSON serializable); results must hold plain "
        "dicts/lists/str/int/float/bool/None"
    )
    assert str(info.value) == message
    assert info.value.row == 2
    assert (len(rec_x.bodies), len(rec_y.bodies)) == (1, 0)
    written = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))
    assert [e.get("aggregation_error") for e in written] == [None, f"InputError: {message}"]
    assert os.listdir(tmp_path) == ["m.json"]


async def test_cancel_during_the_request_removes_the_spool_folder(tmp_path: Path) -> None:
    recorder = _Recorder()
    recorder.release = asyncio.Event()
    output = tmp_path / "out" / "m.json"
    async with recorder.serving() as port:
        cfg = {"env_rec": {"environment_servers": {"recorder": {"host": _HOST, "port": port}}}}
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            rows = [_result(t, 0, 1.0, agent=None, server="env_rec") for t in range(3)]
            task = asyncio.create_task(aggregate_metrics(rows, topology, client, output_path=output))
            entered = asyncio.create_task(recorder.entered.wait())
            try:
                # the call ending (or stalling) before its request arrives fails here, not at a timeout
                await asyncio.wait({task, entered}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert entered.done(), "aggregate_metrics ended or stalled before sending its request"
                [spool_folder] = os.listdir(output.parent)
                assert spool_folder.startswith(".aggregate-")
                assert os.listdir(output.parent / spool_folder) == ["1-body.json"]
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                entered.cancel()
                recorder.release.set()
    assert os.listdir(output.parent) == []


async def test_cancel_while_grouping_stops_and_joins_the_reading_thread(tmp_path: Path) -> None:
    paused, resume = threading.Event(), threading.Event()
    consumed: list[int] = []

    def rows() -> Iterator[dict[str, Any]]:
        for t in range(3 * STOP_CHECK_ROWS):
            consumed.append(t)
            if t == 10:
                paused.set()
                resume.wait(60)
            yield _result(t, 0, 1.0, agent=None, server="env_a")

    async with _deployment(_base_config()) as (deployment, topology, client):
        task = asyncio.create_task(
            aggregate_metrics(rows(), topology, client, output_path=tmp_path / "m.json")
        )
        try:
            pause = asyncio.ensure_future(asyncio.to_thread(paused.wait, 60))
            # the call ending before it reads row 10 fails here, not at a timeout
            await asyncio.wait({task, pause}, return_when=asyncio.FIRST_COMPLETED)
            assert pause.done(), "aggregate_metrics ended before reading row 10"
            assert pause.result() is True
            task.cancel()
            for _ in range(3):
                await asyncio.sleep(0)  # the task handles its cancellation: it asks the thread to stop
        finally:
            paused.set()
            resume.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Joined: the thread had stopped at its next check before the cancellation propagated.
        assert len(consumed) == STOP_CHECK_ROWS + 1
        assert deployment.stats("env_a").aggregate_calls == 0
    assert os.listdir(tmp_path) == []

"""Aggregation without holding the results: ServerClient.post_json_file, the spools, the streamed file.

``post_json_file`` is tested here (not in test_client.py) because aggregation is its user.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import AggregationError, InputError, RecordError, ServerHTTPError, ServerResponseError
from gym_ray.finalize._aggregate_spool import (
    ReplyParts,
    ServerSpools,
    write_metrics_atomic,
)
from gym_ray.finalize.aggregate import (
    aggregate_metrics,
    raise_for_aggregation_errors,
    read_metrics_summary,
    strip_for_aggregation,
)
from gym_ray.servers import compute_aggregate_metrics, serve_config

_HOST = "127.0.0.1"


def _row(task: int, rollout: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "reward": float(task % 2),
        "response": {
            "id": f"r{task}",
            "output": [{"type": "message", "content": "y" * 200}],
            "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13},
        },
        "responses_create_params": {"input": [{"role": "user", "content": "q" * 100}]},
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "_ng_environment_server": "env_stream",
        "agent_ref": {"name": "ag"},
        **extra,
    }


# --- ServerClient.post_json_file ---------------------------------------------------------------------------


class _Flaky:
    """Answers 503 to the first ``failures`` requests, then echoes a digest of the body it read."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen: list[tuple[dict[str, str], bytes]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((dict(request.headers), body))
        if len(self.seen) <= self.failures:
            return web.Response(status=503, text="busy", headers={"Retry-After": "0"})
        return web.json_response({"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/echo", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, _HOST, 0).start()
            yield f"http://{_HOST}:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


async def test_post_json_file_resends_the_whole_body_after_a_503(tmp_path: Path) -> None:
    body = json.dumps({"verify_responses": [strip_for_aggregation(_row(t)) for t in range(3000)]}).encode()
    body_path = tmp_path / "body.json"
    body_path.write_bytes(body)
    flaky = _Flaky(failures=1)
    async with flaky.serving() as url, ServerClient(max_request_retries=1, backoff_base_s=0.01) as client:
        reply = await client.post_json_file(url, "/echo", body_path, headers={"Content-Type": "text/plain"})
    assert reply == {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    assert len(body) > 256 * 1024  # several chunks on the wire
    assert [received for _, received in flaky.seen] == [body, body]
    for headers, _ in flaky.seen:
        assert headers["Content-Length"] == str(len(body))
        assert headers["Content-Type"] == "application/json"
        assert "Transfer-Encoding" not in headers


async def test_post_json_file_without_retries_reports_the_503(tmp_path: Path) -> None:
    body_path = tmp_path / "body.json"
    body_path.write_bytes(b'{"a":1}')
    flaky = _Flaky(failures=1)
    async with flaky.serving() as url, ServerClient(max_request_retries=1) as client:
        with pytest.raises(ServerHTTPError, match=r"answered HTTP 503 after 1 attempt\(s\): 'busy'"):
            await client.post_json_file(url, "/echo", body_path, retry_requests=False)
    assert [received for _, received in flaky.seen] == [b'{"a":1}']


async def test_post_json_file_matches_post_json_on_the_reference_server(tmp_path: Path) -> None:
    cfg = {
        "env_stream": {"environment_servers": {"example_env": {"host": _HOST, "port": 0}}},
    }
    verify_responses = [strip_for_aggregation(_row(t, r)) for t in range(20) for r in range(2)]
    body_path = tmp_path / "body.json"
    body_path.write_bytes(json.dumps({"verify_responses": verify_responses}).encode())
    async with serve_config(cfg) as deployment:
        topology = Topology.from_config(deployment.config)
        async with ServerClient(topology) as client:
            from_file = await client.post_json_file("env_stream", "/aggregate_metrics", body_path)
            from_value = await client.post_json(
                "env_stream", "/aggregate_metrics", {"verify_responses": verify_responses}
            )
        assert deployment.stats("env_stream").aggregate_calls == 2
    assert from_file == from_value == json.loads(json.dumps(compute_aggregate_metrics(verify_responses)))


async def test_post_json_file_names_a_missing_body_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    flaky = _Flaky(failures=0)
    async with flaky.serving() as url, ServerClient() as client:
        with pytest.raises(InputError) as info:
            await client.post_json_file(url, "/echo", missing)
    assert str(info.value).startswith(f"the request body file {missing} for {url}/echo cannot be read (")
    assert info.value.path == str(missing)
    assert flaky.seen == []


class _BigReply:
    """Answers a JSON reply of about ``size`` bytes; the first ``cut`` replies stop halfway (connection
    closed with the body incomplete), the next ``errors`` replies are 500s."""

    def __init__(self, size: int, *, cut: int = 0, errors: int = 0) -> None:
        self.body = json.dumps({"pad": "é" * (size // 2), "n": size}, ensure_ascii=False).encode()
        self.cut, self.errors, self.calls = cut, errors, 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        if self.calls <= self.cut:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(self.body)
            await resp.prepare(request)
            await resp.write(self.body[: len(self.body) // 2])
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.calls <= self.cut + self.errors:
            return web.Response(status=500, text="boom")
        return web.Response(body=self.body, content_type="application/json")

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/big", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, _HOST, 0).start()
            yield f"http://{_HOST}:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


async def test_post_json_file_streams_a_2xx_reply_to_reply_path(tmp_path: Path) -> None:
    body_path, reply_path = tmp_path / "body.json", tmp_path / "reply.json"
    body_path.write_bytes(b'{"a":1}')
    server = _BigReply(600_000, cut=1)
    async with server.serving() as url, ServerClient(max_request_retries=1, backoff_base_s=0.01) as client:
        assert await client.post_json_file(url, "/big", body_path, reply_path=reply_path) is None
    assert server.calls == 2  # the cut reply was retried; the file was rewritten from its start
    assert reply_path.read_bytes() == server.body
    assert len(server.body) == 600_024  # many 64 KiB chunks, multi-byte characters cut between them


async def test_post_json_file_error_status_with_reply_path_reads_the_excerpt(tmp_path: Path) -> None:
    body_path, reply_path = tmp_path / "body.json", tmp_path / "reply.json"
    body_path.write_bytes(b'{"a":1}')
    server = _BigReply(10, errors=1)
    async with server.serving() as url, ServerClient(max_request_retries=1) as client:
        with pytest.raises(ServerHTTPError, match=r"answered HTTP 500 after 1 attempt\(s\): 'boom'") as info:
            await client.post_json_file(url, "/big", body_path, reply_path=reply_path)
    assert info.value.body_excerpt == "boom"
    assert not reply_path.exists()


async def test_post_json_file_names_a_reply_path_it_cannot_write(tmp_path: Path) -> None:
    body_path, reply_path = tmp_path / "body.json", tmp_path / "absent" / "reply.json"
    body_path.write_bytes(b'{"a":1}')
    server = _BigReply(10)
    async with server.serving() as url, ServerClient() as client:
        with pytest.raises(RecordError) as info:
            await client.post_json_file(url, "/big", body_path, reply_path=reply_path)
    assert str(info.value).startswith(f"cannot write the reply of {url}/big to {reply_path} ([Errno 2] ")


# --- spools and the streamed metrics file ---------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param([(0, 0), (0, 1), (1, 0), (1, 0), (2, 5)], id="in-order-streamed"),
        pytest.param([(2, 0), (0, 1), (1, 0), (0, 0), (1, 0), (-1, 3)], id="unordered-sorted-stably"),
    ],
)
def test_spool_body_is_sorted_and_byte_identical_to_the_compact_encoding(
    tmp_path: Path, keys: list[tuple[int, int]]
) -> None:
    values = [
        {"_ng_task_index": t, "_ng_rollout_index": r, "arrival": i, "text": "é\n"}
        for i, (t, r) in enumerate(keys)
    ]
    spools = ServerSpools(tmp_path)
    assert spools.folder is None  # created on the first line only
    for key, value in zip(keys, values, strict=True):
        spools.add("env", key, value)
    spools.finish()
    folder = spools.folder
    assert folder is not None
    assert folder.parent == tmp_path
    assert folder.name.startswith(".aggregate-")
    body = spools.write_body("env", threading.Event())
    expected = sorted(values, key=lambda v: (v["_ng_task_index"], v["_ng_rollout_index"]))
    assert body.read_bytes() == json.dumps({"verify_responses": expected}, separators=(",", ":")).encode()
    assert os.listdir(folder) == [body.name]  # the spool is dropped once its body is written
    spools.remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "value",
    [
        pytest.param([], id="empty"),
        pytest.param([{"a": "ünï ✓", "b": [1, 2.5, None, True, {}], "c": 1e-7, "d": -0.0}], id="awkward"),
        pytest.param([{"big": ["x" * 1000 + str(i) for i in range(3000)]}], id="several-chunks"),
    ],
)
def test_the_metrics_writer_is_byte_identical_to_0_7s(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "sub" / "m.json"
    write_metrics_atomic(path, value, threading.Event())
    expected = orjson.dumps(value, option=orjson.OPT_INDENT_2)  # NeMo Gym 0.7's writer: no newline at the end
    assert path.read_bytes() == expected
    assert os.listdir(path.parent) == ["m.json"]


def test_the_metrics_writer_refuses_nan_and_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("old\n")
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_metrics_atomic(path, [{"x": float("nan")}], threading.Event())
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["m.json"]


_HINT = "the server must answer group_level_metrics (list), agent_metrics (object) and key_metrics (object)"


def _reply_parts(tmp_path: Path, reply_text: str) -> tuple[ServerSpools, ReplyParts]:
    spools = ServerSpools(tmp_path)
    spools.add("env", (0, 0), {"reward": 1.0})
    spools.finish()
    spools.write_body("env", threading.Event())
    spools.reply_path("env").write_text(reply_text, encoding="utf-8")
    keep = ("group_level_metrics", "agent_metrics", "key_metrics", "repeat_level_metrics", "perf_summary")
    return spools, spools.read_reply("env", threading.Event(), keep=keep, what="the reply", hint=_HINT)


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(
            {"group_level_metrics": [], "agent_metrics": {}, "key_metrics": {}, "repeat_level_metrics": None},
            id="empty-lists-and-null",
        ),
        pytest.param(
            {
                "extra": {"dropped": [1, 2]},
                "group_level_metrics": [
                    {},
                    {"a": [], "b": {"c": ['x\n"]{', None]}},
                    {"ü": "✓ 𝄞", "n": -1.5e-9},
                ],
                "agent_metrics": {"mean/reward": 0.5, "nested": {"l": [[], [{}]]}},
                "key_metrics": {},
                "repeat_level_metrics": [{"r": [1, 2, {"d": {}}]}],
                "perf_summary": {"p": None},
            },
            id="nested-unicode-and-every-member",
        ),
    ],
)
def test_streamed_reply_writes_0_7s_bytes(tmp_path: Path, reply: dict[str, Any]) -> None:
    spools, parts = _reply_parts(tmp_path, json.dumps(reply, indent=1))
    assert {k: f.count for k, f in parts.fragments.items()} == {
        k: len(v) for k, v in reply.items() if isinstance(v, list)
    }
    entry = {"agent_ref": {"name": "ag"}, **parts.members, **parts.fragments}
    error_entry = {"agent_ref": {"name": "e"}, "group_level_metrics": [], "aggregation_error": "X: y"}
    write_metrics_atomic(tmp_path / "m.json", [entry, error_entry], threading.Event())
    assert "extra" not in entry  # not kept
    expected_entry = {k: reply[k] if k != "agent_ref" else {"name": "ag"} for k in entry}
    expected = orjson.dumps([expected_entry, error_entry], option=orjson.OPT_INDENT_2)
    assert (tmp_path / "m.json").read_bytes() == expected
    assert not spools.reply_path("env").exists()  # read once, then deleted
    spools.remove()


@pytest.mark.parametrize(
    ("reply_text", "message"),
    [
        pytest.param(
            '{"group_level_metrics": [{"a": 1}, "x"], "agent_metrics": {}, "key_metrics": {}}',
            'the reply that has group_level_metrics[1] = a JSON string ("x"), not an object; ' + _HINT,
            id="non-object-element",
        ),
        pytest.param(
            '{"repeat_level_metrics": [{"a": NaN}], "agent_metrics": {}, "key_metrics": {}}',
            "the reply whose repeat_level_metrics[0] is not strict JSON (Out of range float values are not "
            "JSON compliant: nan); " + _HINT,
            id="nan-element",
        ),
        pytest.param(
            '{"group_level_metrics": [], "group_level_metrics": []}',
            "the reply that names 'group_level_metrics' twice; " + _HINT,
            id="streamed-key-twice",
        ),
        pytest.param(
            '{"group_level_metrics": [{"a": 1}, {"b"',
            "the reply that is not one JSON object: it ends too early (truncated) at character 39; " + _HINT,
            id="truncated",
        ),
    ],
)
def test_bad_replies_are_server_response_errors(tmp_path: Path, reply_text: str, message: str) -> None:
    with pytest.raises(ServerResponseError) as info:
        _reply_parts(tmp_path, reply_text)
    assert str(info.value) == message
    assert info.value.body_excerpt == reply_text


# --- memory does not grow with the number of results on the request side -------------------------------


class _Digest:
    """An /aggregate_metrics server that streams the body (never holds it) and answers its digest."""

    def __init__(self) -> None:
        self.digests: list[tuple[int, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(1 << 16):
            digest.update(chunk)
            size += len(chunk)
        self.digests.append((size, digest.hexdigest()))
        return web.json_response({"group_level_metrics": [], "agent_metrics": {}, "key_metrics": {"n": size}})

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


def _rows(n: int) -> Iterator[dict[str, Any]]:
    return (_row(t, note=f"row {t}") for t in range(n))


async def _request_side_peak(n: int, tmp_path: Path) -> tuple[int, tuple[int, str]]:
    server = _Digest()
    expected = json.dumps(
        {"verify_responses": [strip_for_aggregation(r) for r in _rows(n)]}, separators=(",", ":")
    ).encode()
    async with server.serving() as port:
        cfg = {"env_stream": {"environment_servers": {"recorder": {"host": _HOST, "port": port}}}}
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            tracemalloc.start()
            try:
                await aggregate_metrics(_rows(n), topology, client, output_path=tmp_path / f"m{n}.json")
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert server.digests == [(len(expected), hashlib.sha256(expected).hexdigest())]
    return peak, server.digests[0]


async def test_request_side_memory_does_not_grow_with_the_results(tmp_path: Path) -> None:
    small, _ = await _request_side_peak(1000, tmp_path)
    large, (size, _) = await _request_side_peak(8000, tmp_path)
    # Holding the 7000 extra stripped results would cost several MB (1.7 MB as compact JSON text alone).
    assert size == 1741802
    assert large - small < 1024 * 1024, (small, large)
    assert sorted(os.listdir(tmp_path)) == ["m1000.json", "m8000.json"]


# --- memory does not grow with the number of tasks: the whole call, request and reply -------------------


def _task_rows(n: int) -> Iterator[dict[str, Any]]:
    # Two rollouts per task: group_level_metrics has n entries, each with two rollout_infos.
    return (_row(t, r, note=f"row {t}") for t in range(n) for r in range(2))


def _expected_file(n: int, label: str) -> bytes:
    reply = json.loads(
        json.dumps(compute_aggregate_metrics([strip_for_aggregation(r) for r in _task_rows(n)]))
    )
    entry = {"agent_ref": {"name": label}, "_ng_environment_server": "env_stream"}
    entry |= {k: reply[k] for k in ("agent_metrics", "key_metrics", "group_level_metrics")}
    entry |= {k: reply[k] for k in ("repeat_level_metrics", "perf_summary") if reply.get(k) is not None}
    return json.dumps([entry], indent=2, ensure_ascii=False, allow_nan=False).encode()


@pytest.fixture(scope="module")
def reference_config() -> Iterator[dict[str, Any]]:
    """The reference environment server, in a separate process so that tracemalloc sees only the client."""
    from gym_ray.bench.dispatch import serve_bench_server

    cfg = {"env_stream": {"environment_servers": {"example_env": {"host": _HOST, "port": 0}}}}
    with serve_bench_server(cfg) as config:
        yield config


async def _whole_call_peak(n: int, tmp_path: Path, config: dict[str, Any]) -> int:
    topology = Topology.from_config(config)
    output = tmp_path / f"m{n}.json"
    async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
        tracemalloc.start()
        try:
            await aggregate_metrics(_task_rows(n), topology, client, output_path=output)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    if n <= 1000:
        assert output.read_bytes() == _expected_file(n, "ag")
    else:
        with output.open("rb") as handle:  # cheap checks: the file is too big to compare cheaply here
            head = handle.read(200).decode()
        assert head.startswith('[\n  {\n    "agent_ref": {\n      "name": "ag"\n    },\n')
    return peak


async def test_whole_call_memory_does_not_grow_with_the_tasks(
    tmp_path: Path, reference_config: dict[str, Any]
) -> None:
    small = await _whole_call_peak(1000, tmp_path, reference_config)
    large = await _whole_call_peak(8000, tmp_path, reference_config)
    groups = json.loads((tmp_path / "m8000.json").read_text(encoding="utf-8"))[0]["group_level_metrics"]
    assert [g["_ng_task_index"] for g in groups] == list(range(8000))
    assert [len(g["rollout_infos"]) for g in groups] == [2] * 8000
    # Holding the 7000 extra groups would cost tens of MB (their reply alone is several MB of text).
    assert large - small < 1024 * 1024, (small, large)
    assert sorted(os.listdir(tmp_path)) == ["m1000.json", "m8000.json"]


class _RawReply:
    """An /aggregate_metrics server that answers fixed bytes (status 200, JSON content type)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=self.text, content_type="application/json")

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


async def test_a_bad_element_in_a_reply_is_that_servers_aggregation_error(tmp_path: Path) -> None:
    server = _RawReply('{"group_level_metrics": [{"a": 1}, 7], "agent_metrics": {}, "key_metrics": {}}')
    async with server.serving() as port:
        cfg = {"env_stream": {"environment_servers": {"raw": {"host": _HOST, "port": port}}}}
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            with pytest.raises(ServerResponseError) as info:
                await aggregate_metrics(_rows(3), topology, client, output_path=tmp_path / "m.json")
    message = (
        "/aggregate_metrics on 'env_stream' answered a body that has group_level_metrics[1] = a JSON number "
        f"(7), not an object; {_HINT}"
    )
    assert str(info.value) == message
    assert info.value.body_excerpt == server.text
    assert json.loads((tmp_path / "m.json").read_text(encoding="utf-8")) == [
        {
            "agent_ref": {"name": "ag"},
            "_ng_environment_server": "env_stream",
            "agent_metrics": {},
            "key_metrics": {},
            "group_level_metrics": [],
            "aggregation_error": f"ServerResponseError: {message}",
        }
    ]
    assert os.listdir(tmp_path) == ["m.json"]  # the spool folder (body, reply, fragments) is gone


# --- reading the metrics file back without its per-task lists ------------------------------------------


def test_read_metrics_summary_drops_only_the_per_task_lists(tmp_path: Path) -> None:
    entries = [
        {
            "agent_ref": {"name": "a"},
            "_ng_environment_server": "env_a",
            "agent_metrics": {"mean/reward": 0.5, "note": '[{"]'},
            "key_metrics": {"mean/reward": 0.5},
            "group_level_metrics": [{"_ng_task_index": t, "rollout_infos": [{"r": 1}]} for t in range(50)],
            "repeat_level_metrics": [{"repeat": 0}],
        },
        {"agent_ref": {"name": "b"}, "_ng_environment_server": "env_b", "aggregation_error": "boom"},
    ]
    path = tmp_path / "rollouts_aggregate_metrics.json"
    path.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
    assert read_metrics_summary(path) == [
        {
            "agent_ref": {"name": "a"},
            "_ng_environment_server": "env_a",
            "agent_metrics": {"mean/reward": 0.5, "note": '[{"]'},
            "key_metrics": {"mean/reward": 0.5},
        },
        {"agent_ref": {"name": "b"}, "_ng_environment_server": "env_b", "aggregation_error": "boom"},
    ]
    with pytest.raises(AggregationError, match="env_b: boom"):
        raise_for_aggregation_errors(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param(
            '{"a": 1}',
            r"is not a JSON array of objects: Expecting a JSON array '\[' at character 0",
            id="object",
        ),
        pytest.param('[{"a": 1}', r"is not a JSON array of objects: it ends too early", id="truncated"),
    ],
)
def test_read_metrics_summary_names_a_bad_file(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=match) as info:
        read_metrics_summary(path)
    assert str(path) in str(info.value)

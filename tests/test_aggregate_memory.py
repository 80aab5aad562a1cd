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

import pytest
from aiohttp import web

from gym_ray._internal.aggregate_spool import ServerSpools, write_json_atomic
from gym_ray.aggregate import aggregate_metrics, strip_for_aggregation
from gym_ray.client import ServerClient
from gym_ray.errors import InputError, ServerHTTPError
from gym_ray.servers import compute_aggregate_metrics, serve_config
from gym_ray.topology import Topology

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
def test_write_json_atomic_is_byte_identical_to_json_dumps(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "sub" / "m.json"
    write_json_atomic(path, value, threading.Event())
    expected = (json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    assert path.read_bytes() == expected
    assert os.listdir(path.parent) == ["m.json"]


def test_write_json_atomic_refuses_nan_and_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("old\n")
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json_atomic(path, [{"x": float("nan")}], threading.Event())
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["m.json"]


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

"""ServerClient, fetch_global_config and HeadClientCache against real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import random
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import formatdate
from typing import Any

import pytest
import yaml
from aiohttp import web

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ClientState, LoadSample, ServerClient
from gym_ray.dispatch.head import HeadClientCache, fetch_global_config, setup_server_client
from gym_ray.errors import (
    ConfigError,
    InputError,
    ServerConnectionError,
    ServerHTTPError,
    ServerResponseError,
    UsageError,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    """An aiohttp server on an ephemeral 127.0.0.1 port answering every path with ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Sleeps:
    """An injected sleep that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.calls.append(delay_s)
        await asyncio.sleep(0)


def status_sequence(
    statuses: list[int], *, headers: dict[str, str] | None = None
) -> tuple[Handler, list[int]]:
    """A handler answering the given statuses in turn (then 200 ``{"ok": n}``), and its request count."""
    seen: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        seen.append(1)
        n = len(seen)
        if n <= len(statuses):
            return web.Response(status=statuses[n - 1], text=f"error {n}", headers=headers)
        return web.json_response({"ok": n})

    return handler, seen


def expected_backoffs(seed: int, count: int, *, base_s: float = 0.5, cap_s: float = 30.0) -> list[float]:
    rng = random.Random(seed)
    return [min(cap_s, base_s * 2.0**i) * (0.5 + 0.5 * rng.random()) for i in range(count)]


# --- head config --------------------------------------------------------------------------------


HEAD_CONFIG: dict[str, Any] = {
    "head_server": {"host": "127.0.0.1", "port": 11000},
    "math_env": {"environment_servers": {"example_env": {"host": "127.0.0.1", "port": 14321}}},
    "num_repeats": 4,
}


async def test_fetch_global_config_round_trip() -> None:
    async def handler(request: web.Request) -> web.Response:
        assert request.path == "/global_config_dict_yaml"
        return web.json_response(yaml.safe_dump(HEAD_CONFIG))

    async with serve(handler) as url:
        assert await fetch_global_config(url) == HEAD_CONFIG
        assert await fetch_global_config(url + "/", timeout_s=5.0) == HEAD_CONFIG


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        pytest.param(
            web.json_response({"a": 1}), "a JSON dict, expected a JSON string holding YAML", id="json-dict"
        ),
        pytest.param(web.json_response("a: [1"), "not valid YAML", id="bad-yaml"),
        pytest.param(web.json_response("- 1\n- 2\n"), "YAML holding a list", id="yaml-list"),
        pytest.param(web.Response(text="<html>"), "a body that is not JSON", id="not-json"),
    ],
)
async def test_fetch_global_config_bad_reply(reply: web.Response, needle: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return reply

    async with serve(handler) as url:
        with pytest.raises(ServerResponseError) as info:
            await fetch_global_config(url)
    assert needle in str(info.value)
    assert f"{url}/global_config_dict_yaml" in str(info.value)
    assert info.value.url == f"{url}/global_config_dict_yaml"


async def test_fetch_global_config_no_head() -> None:
    url = closed_port_url()
    with pytest.raises(ServerConnectionError) as info:
        await fetch_global_config(url)
    assert f"head server at {url}" in str(info.value)
    assert "is `gym-ray serve` / the NeMo Gym head running?" in str(info.value)


# --- requests and JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"responses_create_params": {"input": "héllo"}, "n": 1}, id="object"),
        pytest.param([1, 2.5, None, True], id="list"),
        pytest.param("text", id="string"),
    ],
)
async def test_post_json_round_trip(body: Any) -> None:
    seen: list[tuple[str, str, str | None, int]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(
            (
                request.method,
                request.content_type,
                request.headers.get("X-Trace"),
                len(request.headers.getall("Content-Type")),
            )
        )
        return web.Response(body=await request.read(), content_type="application/json")

    async with serve(handler) as url, ServerClient() as client:
        assert (
            await client.post_json(url, "/run", body, headers={"X-Trace": "t1", "content-type": "text/plain"})
            == body
        )
    assert seen == [("POST", "application/json", "t1", 1)]


async def test_post_json_sends_the_bytes_json_dumps_gives_with_ascii_escapes() -> None:
    """What NeMo Gym's client sends: compact, non-ASCII and DEL escaped, floats as Python writes them."""
    bodies = [
        {"input": "What is 2 + 3?", "n": 1, "x": 0.5, "ok": True, "none": None},
        {"input": "caf\u00e9 \U0001f600 \x7f", "big": 1e-05, "long": 12345678901234567890},
        [-0.0, None, {"k": [1.0, 2.5e16, 2**70]}],
        {"input": "ASCII but DEL: \x7f"},
    ]
    received: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"ok": True})

    async with serve(handler) as url, ServerClient() as client:
        for body in bodies:
            await client.post_json(url, "/run", body)
    assert received == [json.dumps(body, separators=(",", ":")).encode("ascii") for body in bodies]
    assert received[1].startswith(b'{"input":"caf\\u00e9 \\ud83d\\ude00 \\u007f","big":1e-05,')
    assert received[2] == b'[-0.0,null,{"k":[1.0,2.5e+16,1180591620717411303424]}]'


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
async def test_post_json_refuses_a_number_json_cannot_carry_and_sends_nothing(value: float) -> None:
    received: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"ok": True})

    async with serve(handler) as url, ServerClient() as client:
        with pytest.raises(InputError, match=r"/run is not JSON-serialisable \(Out of range float values"):
            await client.post_json(url, "/run", {"input": "q", "temperature": value})
    assert received == []


async def test_get_json_and_instance_names_resolve_through_the_topology() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "method": request.method})

    async with serve(handler) as url:
        port = int(url.rsplit(":", 1)[1])
        topology = Topology.from_config(
            {"math_env": {"environment_servers": {"example_env": {"host": "127.0.0.1", "port": port}}}}
        )
        async with ServerClient(topology) as client:
            assert client.base_url("math_env") == url
            assert await client.get_json("math_env", "/livez") == {"path": "/livez", "method": "GET"}
            assert await client.post_json("math_env", "/run", {}) == {"path": "/run", "method": "POST"}
            assert client.load_sample() == LoadSample(0, 0, {"math_env": (0, 0)})


async def test_unknown_server_without_topology_is_a_config_error() -> None:
    async with ServerClient() as client:
        with pytest.raises(ConfigError, match=r"server 'math_env' is not an absolute http:// URL"):
            await client.post_json("math_env", "/run", {})


async def test_unserialisable_body_is_an_input_error() -> None:
    async with ServerClient() as client:
        with pytest.raises(InputError, match=r"not JSON-serialisable"):
            await client.post_json("http://127.0.0.1:1", "/run", {"x": object()})


# --- retry policy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("connect_retries", "retry_requests"),
    [
        pytest.param(0, True, id="no-retries"),
        pytest.param(3, True, id="three-retries"),
        pytest.param(2, False, id="connect-retries-ignore-retry_requests"),
    ],
)
async def test_connect_failure_retried_connect_retries_times(
    connect_retries: int, retry_requests: bool
) -> None:
    url = closed_port_url()
    sleeps = Sleeps()
    client = ServerClient(connect_retries=connect_retries, retry_requests=retry_requests, sleep=sleeps)
    async with client:
        with pytest.raises(ServerConnectionError) as info:
            await client.post_json(url, "/run", {"a": 1})
        assert client.load_sample() == LoadSample(0, 0, {url: (0, 0)})
    assert len(sleeps.calls) == connect_retries
    assert f"could not connect to {url}/run after {connect_retries + 1} attempt(s)" in str(info.value)
    assert info.value.url == f"{url}/run"


def dropping_handler() -> tuple[Handler, list[bytes]]:
    bodies: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    return handler, bodies


@pytest.mark.parametrize(
    ("client_default", "per_call", "expected_requests"),
    [
        pytest.param(False, None, 1, id="default-off"),
        pytest.param(True, None, 3, id="default-on"),
        pytest.param(True, False, 1, id="call-overrides-off"),
        pytest.param(False, True, 3, id="call-overrides-on"),
    ],
)
async def test_dropped_connection_replayed_only_when_allowed(
    client_default: bool, per_call: bool | None, expected_requests: int
) -> None:
    handler, bodies = dropping_handler()
    sleeps = Sleeps()
    async with serve(handler) as url:
        async with ServerClient(retry_requests=client_default, max_request_retries=2, sleep=sleeps) as client:
            with pytest.raises(ServerConnectionError) as info:
                await client.post_json(url, "/run", {"k": 1}, retry_requests=per_call)
    assert bodies == [b'{"k":1}'] * expected_requests
    assert len(sleeps.calls) == expected_requests - 1
    assert (
        f"the connection to {url}/run broke before a full reply after {expected_requests} attempt(s)"
        in str(info.value)
    )


@pytest.mark.parametrize("status", [pytest.param(s, id=str(s)) for s in (400, 404, 409, 422, 500, 501)])
async def test_error_statuses_other_than_gateway_and_429_are_never_retried(status: int) -> None:
    handler, seen = status_sequence([status] * 5)
    sleeps = Sleeps()
    async with serve(handler) as url, ServerClient(retry_requests=True, sleep=sleeps) as client:
        with pytest.raises(ServerHTTPError) as info:
            await client.post_json(url, "/run", {})
    assert len(seen) == 1
    assert sleeps.calls == []
    assert (info.value.status, info.value.body_excerpt, info.value.retry_after_s) == (status, "error 1", None)
    assert f"POST {url}/run answered HTTP {status} after 1 attempt(s)" in str(info.value)


@pytest.mark.parametrize("status", [pytest.param(s, id=str(s)) for s in (502, 503, 504)])
async def test_gateway_statuses_retried_when_allowed(status: int) -> None:
    handler, seen = status_sequence([status, status])
    sleeps = Sleeps()
    async with serve(handler) as url:
        async with ServerClient(retry_requests=True, sleep=sleeps, rng=random.Random(7)) as client:
            assert await client.post_json(url, "/run", {}) == {"ok": 3}
    assert len(seen) == 3
    assert sleeps.calls == expected_backoffs(7, 2)


async def test_gateway_status_not_retried_when_replay_is_off() -> None:
    handler, seen = status_sequence([503])
    async with serve(handler) as url, ServerClient(retry_requests=True) as client:
        with pytest.raises(ServerHTTPError) as info:
            await client.post_json(url, "/run", {}, retry_requests=False)
    assert (len(seen), info.value.status) == (1, 503)


async def test_gateway_status_retries_exhausted() -> None:
    handler, seen = status_sequence([503] * 10)
    sleeps = Sleeps()
    async with serve(handler) as url:
        async with ServerClient(max_request_retries=4, sleep=sleeps) as client:
            with pytest.raises(ServerHTTPError) as info:
                await client.post_json(url, "/run", {})
    assert len(seen) == 5
    assert len(sleeps.calls) == 4
    assert (info.value.status, info.value.body_excerpt) == (503, "error 5")
    assert "after 5 attempt(s)" in str(info.value)


@pytest.mark.parametrize(
    ("status", "retry_after", "max_backoff_s", "expected_sleep"),
    [
        pytest.param(429, "7", 30.0, 7.0, id="429-seconds"),
        pytest.param(503, "2.5", 30.0, 2.5, id="503-seconds"),
        pytest.param(429, "120", 30.0, 30.0, id="capped"),
        pytest.param(429, formatdate(1_000_012.0, usegmt=True), 30.0, 12.0, id="http-date"),
    ],
)
async def test_retry_after_honoured(
    status: int, retry_after: str, max_backoff_s: float, expected_sleep: float
) -> None:
    handler, seen = status_sequence([status], headers={"Retry-After": retry_after})
    sleeps = Sleeps()
    async with serve(handler) as url:
        client = ServerClient(sleep=sleeps, max_backoff_s=max_backoff_s, clock=lambda: 1_000_000.0)
        async with client:
            assert await client.post_json(url, "/run", {}) == {"ok": 2}
    assert sleeps.calls == [expected_sleep]
    assert len(seen) == 2


async def test_retry_after_reported_when_not_retried() -> None:
    handler, _ = status_sequence([429], headers={"Retry-After": "9"})
    async with serve(handler) as url, ServerClient(retry_requests=False) as client:
        with pytest.raises(ServerHTTPError) as info:
            await client.post_json(url, "/run", {})
    assert (info.value.status, info.value.retry_after_s) == (429, 9.0)


async def test_timeout_is_a_connection_error_naming_the_timeout() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(1)
        await release.wait()
        return web.json_response({})

    async with serve(handler) as url:
        try:
            async with ServerClient(retry_requests=False, request_timeout_s=0.2) as client:
                with pytest.raises(ServerConnectionError) as info:
                    await client.post_json(url, "/run", {})
                with pytest.raises(ServerConnectionError, match=r"within the request timeout \(0.1 s\)"):
                    await client.post_json(url, "/run", {}, timeout_s=0.1)
        finally:
            release.set()
    assert f"no reply from {url}/run within the request timeout (0.2 s) after 1 attempt(s)" in str(info.value)
    assert len(seen) == 2


# --- reply errors ------------------------------------------------------------------------------------


async def test_bad_json_is_a_response_error() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="not json")

    async with serve(handler) as url, ServerClient() as client:
        with pytest.raises(ServerResponseError) as info:
            await client.post_json(url, "/run", {})
    assert (info.value.url, info.value.status, info.value.body_excerpt) == (f"{url}/run", 200, "not json")
    assert f"POST {url}/run answered HTTP 200 with a body that is not JSON" in str(info.value)


@pytest.mark.parametrize(
    ("body", "excerpt"),
    [
        pytest.param("x" * 5000, "x" * 2000 + "…", id="capped"),
        pytest.param("y" * 2000, "y" * 2000, id="exactly-at-cap"),
        pytest.param("short", "short", id="short"),
    ],
)
async def test_body_excerpt_capped_at_2000_chars(body: str, excerpt: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=400, text=body)

    async with serve(handler) as url, ServerClient() as client:
        with pytest.raises(ServerHTTPError) as info:
            await client.post_json(url, "/run", {})
    assert info.value.body_excerpt == excerpt


# --- load sample, cancellation, lifetime ---------------------------------------------------------------


async def wait_until(predicate: Callable[[], bool]) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached within 10 s")


async def test_load_sample_counts_waiting_and_running_exactly() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(1)
        await release.wait()
        return web.json_response(len(seen))

    n = 5
    async with serve(handler) as url, ServerClient(max_connections=2) as client:
        assert client.load_sample() == LoadSample(0, 0, {})
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(client.post_json(url, "/run", {"i": i})) for i in range(n)]
            await wait_until(lambda: len(seen) == 2 and client.load_sample().waiting == n - 2)
            for _ in range(20):  # give a third request every chance to slip through
                await asyncio.sleep(0)
            assert client.load_sample() == LoadSample(waiting=n - 2, running=2, per_server={url: (n - 2, 2)})
            assert len(seen) == 2
            release.set()
        assert sorted(t.result() for t in tasks)[-1] == n
        assert client.load_sample() == LoadSample(0, 0, {url: (0, 0)})


async def test_cancellation_propagates_and_releases_the_slot() -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    async with serve(handler) as url:
        try:
            async with ServerClient(max_connections=1) as client:
                first = asyncio.create_task(client.post_json(url, "/run", {}))
                second = asyncio.create_task(client.post_json(url, "/run", {}))
                await wait_until(lambda: client.load_sample() == LoadSample(1, 1, {url: (1, 1)}))
                for task in (first, second):
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                assert client.load_sample() == LoadSample(0, 0, {url: (0, 0)})
        finally:
            release.set()


async def test_aclose_refuses_reuse() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({})

    async with serve(handler) as url:
        client = ServerClient()
        assert client.state is ClientState.UNOPENED
        assert await client.post_json(url, "/run", {}) == {}
        assert (client.state, client.open_sessions) == (ClientState.OPENED, 1)
        await client.aclose()
        await client.aclose()
        assert (client.state, client.open_sessions) == (ClientState.CLOSED, 0)
        with pytest.raises(RuntimeError, match="has been closed"):
            await client.post_json(url, "/run", {})
        with pytest.raises(RuntimeError, match="Cannot reopen"):
            async with client:
                pass
        async with ServerClient() as entered:
            with pytest.raises(RuntimeError, match="more than once"):
                await entered.__aenter__()


async def test_one_session_per_event_loop() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"loop": "ok"})

    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        async with serve(handler) as url:
            client = ServerClient()
            assert await client.post_json(url, "/run", {}) == {"loop": "ok"}
            future = asyncio.run_coroutine_threadsafe(client.post_json(url, "/run", {}), other)
            assert await asyncio.wrap_future(future) == {"loop": "ok"}
            assert client.open_sessions == 2
            assert await client.post_json(url, "/run", {}) == {"loop": "ok"}
            assert client.open_sessions == 2
            await client.aclose()
            assert client.open_sessions == 0
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(timeout=10)
        other.close()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        pytest.param({"max_connections": 0}, "max_connections", id="max_connections"),
        pytest.param({"connect_retries": -1}, "connect_retries", id="connect_retries"),
        pytest.param({"request_timeout_s": 0.0}, "request_timeout_s", id="request_timeout_s"),
        pytest.param({"connect_timeout_s": None}, "connect_timeout_s", id="connect_timeout_s-none"),
    ],
)
def test_bad_limits_are_config_errors(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        ServerClient(**kwargs)
    assert info.value.key == key


# --- head client cache -------------------------------------------------------------------------------


async def test_cache_refetches_and_rebuilds_only_when_the_config_differs() -> None:
    config: dict[str, Any] = {"a": 1}
    fetches: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        fetches.append(1)
        return web.json_response(yaml.safe_dump(config))

    built: list[ServerClient] = []

    def factory(cfg: dict[str, Any]) -> ServerClient:
        built.append(ServerClient())
        return built[-1]

    cache = HeadClientCache(client_factory=factory)
    async with serve(handler) as url:
        cfg1, client1 = await setup_server_client(url, cache=True, helper_cache=cache)
        cfg2, client2 = await setup_server_client(url, cache=True, helper_cache=cache)
        assert (cfg1, cfg2, client2 is client1, len(fetches), len(built)) == ({"a": 1}, {"a": 1}, True, 2, 1)
        cfg1["a"] = 99  # a caller mutating its copy does not poison the cache
        _, client3 = await setup_server_client(url, cache=True, helper_cache=cache)
        assert (client3 is client1, len(built)) == (True, 1)
        config["a"] = 2
        cfg4, client4 = await setup_server_client(url, cache=True, helper_cache=cache)
        assert (cfg4, client4 is client1, len(fetches), len(built)) == ({"a": 2}, False, 4, 2)
        assert client1.state is ClientState.CLOSED
        uncached = [await setup_server_client(url, client_factory=factory) for _ in range(2)]
        assert (len(fetches), len(built)) == (6, 4)
        assert uncached[0][1] is not uncached[1][1]
        for _, client in uncached:
            await client.aclose()
        await cache.aclose()
    assert client4.state is ClientState.CLOSED


async def test_cache_opt_in_needs_a_helper_cache() -> None:
    with pytest.raises(UsageError, match=r"needs helper_cache=HeadClientCache\(\)"):
        await setup_server_client("http://127.0.0.1:1", cache=True)


def test_load_sample_pickles() -> None:
    sample = LoadSample(waiting=1, running=2, per_server={"env": (1, 2)})
    assert pickle.loads(pickle.dumps(sample)) == sample

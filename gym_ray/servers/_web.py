"""Shared aiohttp plumbing of the reference servers: health routes, JSON bodies, cancelling runners.

Every reference server runs on an ``AppRunner`` built by ``make_runner``, which turns on aiohttp's
``handler_cancellation`` (off by default since aiohttp 3.9): when a client disconnects, the handler task
is cancelled, like NeMo Gym's ``ClientDisconnectCancellationMiddleware``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gym_ray.errors import ConfigError, InputError, InternalError
from gym_ray.servers.metrics import compute_aggregate_metrics
from gym_ray.servers.stats import StatsRecorder

#: Seconds a stopping server waits for running handlers before cancelling them.
SHUTDOWN_TIMEOUT_S = 0.5

HEALTH_PATHS = ("/", "/livez", "/readyz", "/healthz", "/health")
_READY_PATHS = frozenset({"/readyz", "/healthz", "/health"})


def add_health_routes(app: web.Application, *, is_ready: Callable[[], bool] = lambda: True) -> None:
    """``GET /`` and ``/livez`` -> ``{"status": "ok"}``; ``/readyz``, ``/healthz``, ``/health`` -> the
    same once ``is_ready()``, 503 ``{"status": "starting"}`` before."""

    def handler_for(path: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            if path in _READY_PATHS and not is_ready():
                return web.json_response({"status": "starting"}, status=503)
            return web.json_response({"status": "ok"})

        return handler

    for path in HEALTH_PATHS:
        app.router.add_get(path, handler_for(path))


def error_response(status: int, message: str) -> web.Response:
    """A JSON error reply ``{"error": message}``."""
    return web.json_response({"error": message}, status=status)


async def read_json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object body, or a 400/422 error reply naming the problem."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return error_response(
            400, f"{request.method} {request.path}: body is not JSON ({exc}); send a JSON object"
        )
    if not isinstance(body, dict):
        return error_response(
            422, f"{request.method} {request.path}: body is a JSON {type(body).__name__}; send a JSON object"
        )
    return body


#: Largest request body the reference servers accept. Effectively no limit, as with NeMo Gym's uvicorn
#: servers: ``/aggregate_metrics`` carries every stripped success of a server in one body (~1 KB each, so
#: about 1 GB for a million rollouts), and aiohttp's default (1 MiB) or a fixed cap would refuse a large run.
MAX_BODY_BYTES = 1 << 40


async def handle_aggregate_metrics(
    request: web.Request, stats: StatsRecorder, *, error_status: int | None = None
) -> web.Response:
    """``POST /aggregate_metrics``: ``{"verify_responses": [...]}`` -> ``compute_aggregate_metrics``."""
    stats.aggregate_calls += 1
    if error_status is not None:
        stats.count_fault("aggregate_status")
        return error_response(error_status, f"injected fault: /aggregate_metrics HTTP {error_status}")
    body = await read_json_object(request)
    if isinstance(body, web.Response):
        return body
    responses = body.get("verify_responses")
    if not isinstance(responses, list):
        return error_response(
            422, f"POST /aggregate_metrics: verify_responses = {responses!r:.80} is not a list; send a list"
        )
    try:
        metrics = compute_aggregate_metrics(responses)
    except InputError as exc:
        return error_response(422, f"POST /aggregate_metrics: {exc}")
    return web.json_response(metrics)


def make_runner(app: web.Application) -> web.AppRunner:
    """An ``AppRunner`` that cancels handlers on client disconnect and logs no access lines."""
    return web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None)


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port the runner's (single) site listens on."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise InternalError("a reference server has no bound TCP address after start")


def field_path(instance: str, server_type: str, implementation: str, field: str) -> str:
    """The dotted config path of an implementation field, for error messages."""
    return f"{instance}.{server_type}.{implementation}.{field}"


def get_number(
    fields: Mapping[str, Any],
    name: str,
    default: float,
    *,
    where: str,
    low: float = 0.0,
    high: float | None = None,
) -> float:
    """A numeric implementation field, checked against [low, high]."""
    value = fields.get(name, default)
    if value is None:
        return default
    key = f"{where}.{name}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} = {value!r} is not a number", key=key)
    if value < low or (high is not None and value > high):
        bound = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ConfigError(f"{key} = {value!r} is outside {bound}", key=key)
    return float(value)

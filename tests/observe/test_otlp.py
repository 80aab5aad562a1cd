"""OTLP end to end on Ray: a real OTLP/HTTP receiver (aiohttp on 127.0.0.1, protobuf decoded with
``opentelemetry-proto``) and a 2-worker run with the exporter's default batch settings. Every span and
every metric point recorded in the worker processes must arrive, although the actors are killed at the
end of the run: they are closed (flushed) first."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gym_ray import keys
from gym_ray.distributed.api import acollect
from gym_ray.observe.tracing import JOB_SPAN, ROLLOUT_SPAN, shutdown_tracing
from gym_ray.servers import bundled_dataset_path, load_bundled_config, start_in_thread
from tests.summaries import workers_that_dispatched

trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
metrics_pb2 = pytest.importorskip("opentelemetry.proto.collector.metrics.v1.metrics_service_pb2")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ENVS = ("arith_env", "arith_env_hard")
ROWS = 40
FAILING = (3, 13, 23, 33)  # rows the reference server answers with HTTP 500


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    links: list[tuple[str, str]]
    attributes: dict[str, Any]
    status_code: int
    pid: int


@dataclass
class Receiver:
    """What the OTLP/HTTP endpoint received: spans, and metric exports by process id (in order)."""

    url: str = ""
    spans: list[Span] = field(default_factory=list)
    metric_exports: dict[int, list[dict[str, list[tuple[dict[str, Any], float]]]]] = field(
        default_factory=dict
    )


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


async def _body(request: web.Request) -> bytes:
    data = await request.read()
    if request.headers.get("Content-Encoding") == "gzip":
        data = gzip.decompress(data)
    return data


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    got = Receiver()

    async def traces(request: web.Request) -> web.Response:
        message = trace_pb2.ExportTraceServiceRequest.FromString(await _body(request))
        for resource_spans in message.resource_spans:
            pid = int(_attributes(resource_spans.resource.attributes)["process.pid"])
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    got.spans.append(
                        Span(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            attributes=_attributes(span.attributes),
                            status_code=span.status.code,
                            pid=pid,
                        )
                    )
        reply = trace_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def metrics(request: web.Request) -> web.Response:
        message = metrics_pb2.ExportMetricsServiceRequest.FromString(await _body(request))
        for resource_metrics in message.resource_metrics:
            pid = int(_attributes(resource_metrics.resource.attributes)["process.pid"])
            export: dict[str, list[tuple[dict[str, Any], float]]] = {}
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    kind = metric.WhichOneof("data")
                    points = export.setdefault(metric.name, [])
                    for point in getattr(metric, kind).data_points:
                        value = point.count if kind == "histogram" else _value_of_number(point)
                        points.append((_attributes(point.attributes), value))
            got.metric_exports.setdefault(pid, []).append(export)
        reply = metrics_pb2.ExportMetricsServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    got.url = f"http://127.0.0.1:{port}"
    try:
        yield got
    finally:
        await runner.cleanup()


def _value_of_number(point: Any) -> float:
    return float(point.as_int if point.WhichOneof("value") == "as_int" else point.as_double)


def _rows() -> list[dict[str, Any]]:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    rows = []
    for index in range(ROWS):
        row = json.loads(lines[index % len(lines)])
        row[keys.AGENT_REF] = {"name": ("arith_agent", "arith_agent_hard")[index % 2]}
        if index in FAILING:
            row["fault"] = "500"
        rows.append(row)
    return rows


def _final_totals(exports: Mapping[int, list[dict[str, Any]]], name: str) -> Counter[str]:
    """Sum over processes of each process's last export of ``name`` (cumulative), by ``status``."""
    totals: Counter[str] = Counter()
    for per_process in exports.values():
        last = [export[name] for export in per_process if name in export]
        if last:
            for attributes, value in last[-1]:
                totals[str(attributes.get("status", ""))] += int(value)
    return totals


async def test_otlp_receives_every_span_and_metric_of_a_two_worker_run(
    ray_session: Any, receiver: Receiver, tmp_path: Path
) -> None:
    tracing = {"enabled": True, "exporter": "otlp", "otlp_endpoint": receiver.url, "metrics_enabled": True}
    cfg = load_bundled_config()
    for env in ENVS:
        cfg[env]["environment_servers"]["example_env"].update(
            latency_ms=5, latency_jitter_ms=0, tracing=dict(tracing)
        )
    try:
        with start_in_thread(cfg) as servers:
            config = {**servers.config, "tracing": dict(tracing)}
            result = await acollect(
                config,
                rows=_rows(),
                output_dir=str(tmp_path / "run"),
                num_workers=2,
                shard_size=5,
                max_rollout_attempts=1,
                route_failures_to_sidecar=True,
                progress=False,
            )
    finally:
        # This process: the job span (flushed by acollect already) and the servers' spans.
        await asyncio.to_thread(shutdown_tracing)
    assert (result.succeeded, result.failed) == (ROWS - len(FAILING), len(FAILING))

    spans = receiver.spans
    jobs = [s for s in spans if s.name == JOB_SPAN]
    rollouts = [s for s in spans if s.name == ROLLOUT_SPAN]
    clients = [s for s in spans if s.name == "HTTP POST"]
    server_spans = [s for s in spans if s.name == "POST /run"]
    assert (len(jobs), len(rollouts), len(clients), len(server_spans)) == (1, ROWS, ROWS, ROWS)
    assert len(spans) == 1 + 3 * ROWS

    (job,) = jobs
    assert job.attributes["gym_ray.run_id"] == result.run_id
    worker_pids = {s.pid for s in rollouts}
    # One process per worker that sent rollouts (usually both; on a loaded machine one worker can take
    # every shard before the other has started: the hand-out is pull-based), never the caller's.
    assert len(worker_pids) == len(workers_that_dispatched(result.summary_path))
    assert job.pid not in worker_pids
    assert {s.pid for s in clients} == worker_pids
    rollout_by_trace = {s.trace_id: s for s in rollouts}
    assert len(rollout_by_trace) == ROWS  # one trace per rollout
    assert all(s.links == [(job.trace_id, job.span_id)] for s in rollouts)
    assert {s.attributes["gym_ray.run_id"] for s in rollouts} == {result.run_id}
    failed = sorted(s.attributes["gym_ray.task_index"] for s in rollouts if s.status_code == 2)  # ERROR
    assert failed == list(FAILING)
    assert all(
        s.attributes["gym_ray.failure_class"] == "agent_run_error" for s in rollouts if s.status_code == 2
    )
    for client in clients:
        assert client.parent_span_id == rollout_by_trace[client.trace_id].span_id
    client_ids = {s.span_id for s in clients}
    assert all(s.parent_span_id in client_ids for s in server_spans)  # traceparent continued
    assert sorted(s.attributes["http.response.status_code"] for s in server_spans if s.status_code == 2) == [
        500
    ] * len(FAILING)

    exports = {pid: e for pid, e in receiver.metric_exports.items() if pid in worker_pids}
    assert set(exports) == worker_pids
    assert _final_totals(exports, "gym_ray.rollouts") == Counter(
        {"succeeded": ROWS - len(FAILING), "failed": len(FAILING)}
    )
    assert sum(_final_totals(exports, "gym_ray.rollout.latency_ms").values()) == ROWS - len(FAILING)
    assert sum(_final_totals(exports, "gym_ray.rollouts.in_flight").values()) == 0

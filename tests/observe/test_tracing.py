"""Tracing: settings, the job span, one root span per rollout linked to it, traceparent to the server."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.errors import ConfigError
from gym_ray.observe.tracing import (
    Tracer,
    TracingSettings,
    attach_traceparent,
    current_traceparent,
    job_span,
    setup_tracing,
    setup_tracing_from_config,
    shutdown_tracing,
)
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, serve_config


def _config() -> dict[str, Any]:
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "agent"},
                }
            }
        },
    }


def _row(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
        "expected_answer": str(i + 1),
        "agent_ref": {"name": "agent"},
        keys.TASK_INDEX: i,
        keys.ROLLOUT_INDEX: 0,
        **extra,
    }


@pytest.fixture(autouse=True)
def _forget_tracers() -> Iterator[None]:
    yield
    shutdown_tracing()


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    async with serve_config(_config()) as dep:
        yield dep


def _fresh(preset: str = "default", *, metrics: bool = False) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    settings = TracingSettings(enabled=True, preset=preset, exporter="memory", metrics_enabled=metrics)  # type: ignore[arg-type]
    tracer = setup_tracing(
        settings, span_exporter=exporter, metric_reader=InMemoryMetricReader() if metrics else None
    )
    assert tracer is not None
    return tracer, exporter


def _named(spans: Any, name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


# --- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "environ", "expected"),
    [
        pytest.param({}, {}, ("off", "default", "none", "gym-ray"), id="defaults"),
        pytest.param(
            {"tracing": {"enabled": True, "preset": "per_rollout", "exporter": "console"}},
            {},
            ("on", "per_rollout", "console", "gym-ray"),
            id="config-block",
        ),
        pytest.param(
            {"tracing": {"enabled": True, "exporter": "console"}},
            {"OTEL_TRACES_EXPORTER": "memory", "OTEL_SERVICE_NAME": "sweep-7"},
            ("on", "default", "memory", "sweep-7"),
            id="env-wins",
        ),
        pytest.param(
            {"tracing": {"enabled": True}},
            {"OTEL_SDK_DISABLED": "true"},
            ("off", "default", "none", "gym-ray"),
            id="sdk-disabled",
        ),
    ],
)
def test_settings_from_config_and_env(
    cfg: dict[str, Any], environ: dict[str, str], expected: tuple[str, str, str, str]
) -> None:
    s = TracingSettings.from_config(cfg, environ=environ)
    assert ("on" if s.enabled else "off", s.preset, s.exporter, s.service_name) == expected


@pytest.mark.parametrize(
    ("cfg", "environ", "key"),
    [
        pytest.param({"tracing": {"preset": "everything"}}, {}, "tracing.preset", id="bad-preset"),
        pytest.param({"tracing": {"enabld": True}}, {}, "tracing.enabld", id="unknown-key"),
        pytest.param({"tracing": "on"}, {}, "tracing", id="not-a-mapping"),
        pytest.param({}, {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER", id="bad-env-exporter"),
    ],
)
def test_bad_settings_name_the_key(cfg: dict[str, Any], environ: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        TracingSettings.from_config(cfg, environ=environ)
    assert info.value.key == key


def test_otlp_without_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # The exporter is a test dependency: hide it as an environment without it would (None in
    # sys.modules makes the import fail).
    for module in (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp"):
        setup_tracing(TracingSettings(enabled=True, exporter="otlp"))


def test_off_is_none_and_job_span_is_a_no_op() -> None:
    assert setup_tracing(TracingSettings()) is None
    assert setup_tracing_from_config({"tracing": {"enabled": False, "exporter": "memory"}}) is None
    with job_span(None, run_id="r") as span:
        assert span is None
        assert current_traceparent() is None


def test_setup_from_config_is_cached_per_process() -> None:
    cfg = {"tracing": {"enabled": True, "exporter": "memory"}}
    first = setup_tracing_from_config(cfg)
    assert first is not None
    assert first is setup_tracing_from_config(cfg)
    assert first.memory is not None


# --- spans against the reference server ----------------------------------------------------------------


async def test_collect_one_root_span_per_rollout_linked_to_job(
    deployment: Deployment, tmp_path: Path
) -> None:
    cfg = {**deployment.config, "tracing": {"enabled": True, "exporter": "memory"}}
    tracer = setup_tracing_from_config(cfg)
    assert tracer is not None
    assert tracer.memory is not None
    deployment.servers["env"].tracer = tracer  # the server continues traces into the same exporter
    rows = [_row(0), _row(1), _row(2, force_failure="boom")]
    result = await acollect_local(cfg, rows=rows, output_dir=str(tmp_path / "run"))
    assert (result.succeeded, result.failed) == (2, 1)

    spans = tracer.memory.get_finished_spans()
    (job,) = _named(spans, "gym_ray.job")
    rollouts = _named(spans, "gym_ray.rollout")
    assert len(rollouts) == 3
    by_task = {s.attributes["gym_ray.task_index"]: s for s in rollouts}  # type: ignore[index]
    assert sorted(by_task) == [0, 1, 2]
    for span in rollouts:
        assert span.parent is None
        assert span.context.trace_id != job.context.trace_id
        assert [link.context.span_id for link in span.links] == [job.context.span_id]
        assert span.attributes["gym_ray.environment_server"] == "env"  # type: ignore[index]
        assert span.attributes["gym_ray.attempt_index"] == 0  # type: ignore[index]
        assert span.attributes["gym_ray.latency_ms"] > 0  # type: ignore[index,operator]
        assert span.attributes["gym_ray.run_id"] == result.run_id  # type: ignore[index]
    assert by_task[0].attributes["gym_ray.record.status"] == "succeeded"  # type: ignore[index]
    assert by_task[0].status.status_code is StatusCode.UNSET
    failed = by_task[2]
    assert failed.attributes["gym_ray.record.status"] == "failed"  # type: ignore[index]
    assert failed.attributes["gym_ray.failure_class"] == "environment_server_failed"  # type: ignore[index]
    assert failed.status.status_code is StatusCode.ERROR

    clients = _named(spans, "HTTP POST")
    servers = _named(spans, "POST /run")
    assert len(clients) == len(servers) == 3
    rollout_of_trace = {s.context.trace_id: s for s in rollouts}
    for client in clients:
        assert client.kind is SpanKind.CLIENT
        assert client.parent is not None
        assert client.parent.span_id == rollout_of_trace[client.context.trace_id].context.span_id
        assert client.attributes["http.response.status_code"] == 200  # type: ignore[index]
    client_ids = {c.context.span_id for c in clients}
    for server in servers:
        assert server.kind is SpanKind.SERVER
        assert server.context.trace_id in rollout_of_trace  # traceparent propagated
        assert server.parent is not None
        assert server.parent.span_id in client_ids
        assert server.attributes["gym_ray.server.name"] == "env"  # type: ignore[index]


async def test_per_rollout_preset_has_no_job_span_and_no_links(deployment: Deployment) -> None:
    tracer, exporter = _fresh("per_rollout")
    topology = Topology.from_config(deployment.config)
    async with ServerClient(topology) as client:
        with job_span(tracer, run_id="r1") as span:
            assert span is None
            completions = dispatch([_row(0), _row(1)], client, topology, max_resident_tasks=2, tracer=tracer)
            try:
                outcomes = [item async for item in completions]
            finally:
                await completions.aclose()
    assert len(outcomes) == 2
    spans = exporter.get_finished_spans()
    assert _named(spans, "gym_ray.job") == []
    rollouts = _named(spans, "gym_ray.rollout")
    assert len(rollouts) == 2
    assert all(s.parent is None and list(s.links) == [] for s in rollouts)
    assert len({s.context.trace_id for s in rollouts}) == 2


async def test_http_error_span_has_status_and_failure_class(deployment: Deployment) -> None:
    tracer, exporter = _fresh()
    topology = Topology.from_config(deployment.config)
    bad = _row(0, responses_create_params={"no_input": True})  # the server answers 422
    async with ServerClient(topology, retry_requests=False) as client:
        completions = dispatch([bad], client, topology, route_failures_to_sidecar=True, tracer=tracer)
        try:
            outcomes = [item async for item in completions]
        finally:
            await completions.aclose()
    assert outcomes[0][1].failure_class == "agent_run_error"
    (rollout,) = _named(exporter.get_finished_spans(), "gym_ray.rollout")
    assert rollout.status.status_code is StatusCode.ERROR
    assert rollout.attributes["gym_ray.failure_class"] == "agent_run_error"  # type: ignore[index]
    (client_span,) = _named(exporter.get_finished_spans(), "HTTP POST")
    assert client_span.attributes["http.response.status_code"] == 422  # type: ignore[index]


async def test_server_span_of_a_500_reply_has_the_error_status(deployment: Deployment) -> None:
    tracer, exporter = _fresh()
    deployment.servers["env"].tracer = tracer
    topology = Topology.from_config(deployment.config)
    rows = [_row(0), _row(1, fault="500")]  # the reference server answers HTTP 500 to the second
    async with ServerClient(topology, retry_requests=False) as client:
        completions = dispatch(rows, client, topology, route_failures_to_sidecar=True, tracer=tracer)
        try:
            outcomes = [item async for item in completions]
        finally:
            await completions.aclose()
    assert sorted(type(outcome).__name__ for _, outcome in outcomes) == [
        "CompletedRollout",
        "RolloutFailureRecord",
    ]
    servers = _named(exporter.get_finished_spans(), "POST /run")
    by_status = {s.attributes["http.response.status_code"]: s.status for s in servers}  # type: ignore[index]
    assert sorted(by_status) == [200, 500]
    assert by_status[200].status_code is StatusCode.UNSET
    assert (by_status[500].status_code, by_status[500].description) == (StatusCode.ERROR, "HTTP 500")


async def test_metrics_without_a_metric_exporter_say_so_at_start(caplog: pytest.LogCaptureFixture) -> None:
    for exporter in ("none", "file"):
        settings = TracingSettings(
            enabled=True, exporter=exporter, metrics_enabled=True, file_path=os.devnull
        )
        caplog.clear()
        tracer = setup_tracing(settings)
        assert tracer is not None
        assert tracer.metrics is None
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"tracing.metrics_enabled is true but exporter '{exporter}' cannot export metrics: no metrics "
            "are recorded; use exporter otlp, console or memory for metrics"
        ]


async def test_worker_links_to_driver_job_through_traceparent(deployment: Deployment) -> None:
    tracer, exporter = _fresh()
    with job_span(tracer, run_id="r1") as job:
        assert job is not None
        traceparent = current_traceparent()
    assert traceparent is not None
    topology = Topology.from_config(deployment.config)
    async with ServerClient(topology) as client:
        with attach_traceparent(traceparent) as remote:  # what a Ray worker does with the driver's value
            assert remote is not None
            assert remote.span_id == job.get_span_context().span_id
            completions = dispatch([_row(0)], client, topology, tracer=tracer)
            try:
                [item async for item in completions]
            finally:
                await completions.aclose()
    (rollout,) = _named(exporter.get_finished_spans(), "gym_ray.rollout")
    assert [link.context.span_id for link in rollout.links] == [job.get_span_context().span_id]


async def test_run_metrics_count_outcomes(deployment: Deployment) -> None:
    tracer, _ = _fresh(metrics=True)
    assert tracer.metrics is not None
    topology = Topology.from_config(deployment.config)
    rows = [_row(0), _row(1), _row(2, force_failure="boom")]
    async with ServerClient(topology) as client:
        completions = dispatch(rows, client, topology, route_failures_to_sidecar=True, tracer=tracer)
        try:
            [item async for item in completions]
        finally:
            await completions.aclose()
    data = tracer.metrics.collect()
    counts = {(a["status"], a.get("failure_class")): v for a, v in data["gym_ray.rollouts"]}
    assert counts == {("succeeded", None): 2, ("failed", "environment_server_failed"): 1}
    assert data["gym_ray.rollouts.in_flight"] == [({}, 0)]
    assert data["gym_ray.rollout.latency_ms"] == [({}, 2)]

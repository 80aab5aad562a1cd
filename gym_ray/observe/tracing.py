"""OpenTelemetry for gym_ray: the run's ``job`` span, one trace per rollout linked to it, presets, metrics.

Shape of a traced run (preset ``default``)::

    trace J:  gym_ray.job                          (driver; the whole collection of a config)
    trace R1: gym_ray.rollout  --link--> J         (root span of rollout 1: identity, status, latency)
                └─ HTTP POST  (CLIENT)              (the /run request; W3C ``traceparent`` is sent)
                     └─ POST /run  (SERVER)         (recorded by an environment server that continues it)
    trace R2: gym_ray.rollout  --link--> J         ...

Rollouts are never descendants of the job span, so each trace stays bounded by one rollout. The
``per_rollout`` preset omits the job span (no link). Tracing is off by default; when off,
:func:`setup_tracing` returns None and the dispatch hot path pays one ``is None`` test per rollout.

Configuration: the run config's ``tracing:`` block (:class:`TracingSettings`), then the standard
environment variables, which win: ``OTEL_TRACES_EXPORTER`` (``none|console|otlp|memory|file``),
``OTEL_SERVICE_NAME``, ``OTEL_SDK_DISABLED=true`` (forces tracing off), ``OTEL_EXPORTER_OTLP_ENDPOINT``
(read where the run starts and shipped to the actors as ``otlp_endpoint``); without an endpoint the OTLP
exporter reads ``OTEL_EXPORTER_OTLP_*`` in each process.

Processes: a provider is built once per process and settings (cached; :func:`shutdown_tracing` flushes
and forgets them). Providers are not installed as the OpenTelemetry global provider, so several runs with
different settings can share a process. Every process that records telemetry calls
:func:`shutdown_tracing` before it ends (the actors' ``close()``, the CLI on exit), and a collection calls
:meth:`Tracer.flush` when it returns: a span or metric point held by a batch exporter is never lost with
its process. A Ray worker calls :func:`setup_tracing_from_config` with the
run config (``run_shard`` does so itself) and, to link its rollouts to the driver's job span, runs its
shards inside :func:`attach_traceparent` with the driver's :func:`current_traceparent`.

Settings parsing, exporters and the provider cache live in :mod:`gym_ray.observe._otel`;
:class:`TracingSettings` and :class:`JsonlSpanExporter` are re-exported here, and :func:`run_scope` from
:mod:`gym_ray.observe.run_context` (which a run with tracing off imports alone: no OpenTelemetry).

Concurrency: spans are attached to the contextvars of the rollout's own task and detached before it
ends; nothing here creates tasks or threads except the SDK's batch span processor / periodic metric
reader of the ``console`` and ``otlp`` exporters (joined by :func:`shutdown_tracing` or at exit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gym_ray import keys
from gym_ray.config.tracing import TRACING_KEY as TRACING_KEY
from gym_ray.config.tracing import ExporterName as ExporterName
from gym_ray.config.tracing import Preset as Preset
from gym_ray.config.tracing import TracingSettings as TracingSettings
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord, failure_class_for_status
from gym_ray.errors import ConfigError, ServerHTTPError
from gym_ray.observe._otel import JsonlSpanExporter as JsonlSpanExporter
from gym_ray.observe._otel import SettingsCache, build_providers
from gym_ray.observe.run_context import RUN_ID as _RUN_ID
from gym_ray.observe.run_context import run_scope as run_scope

if TYPE_CHECKING:
    from gym_ray.dispatch.client import ServerClient

logger = logging.getLogger(__name__)

__all__ = [
    "PRESETS",
    "TRACING_KEY",
    "JsonlSpanExporter",
    "RunMetrics",
    "Tracer",
    "TracingSettings",
    "attach_traceparent",
    "current_traceparent",
    "job_span",
    "rollout_span",
    "run_scope",
    "setup_tracing",
    "setup_tracing_from_config",
    "shutdown_tracing",
]

#: Span groups of each preset (NeMo Gym's names; the job span is the only difference).
PRESETS: dict[str, frozenset[str]] = {
    "default": frozenset({"job", "rollout", "http_client", "server"}),
    "per_rollout": frozenset({"rollout", "http_client", "server"}),
}

# Span attribute names.
ATTR_TASK_INDEX = "gym_ray.task_index"
ATTR_ROLLOUT_INDEX = "gym_ray.rollout_index"
ATTR_ATTEMPT_INDEX = "gym_ray.attempt_index"
ATTR_ROLLOUT_ID = "gym_ray.rollout_id"
ATTR_ENVIRONMENT_SERVER = "gym_ray.environment_server"
ATTR_STATUS = "gym_ray.record.status"
ATTR_LATENCY_MS = "gym_ray.latency_ms"
ATTR_FAILURE_CLASS = "gym_ray.failure_class"
ATTR_RUN_ID = "gym_ray.run_id"
ATTR_SERVER_NAME = "gym_ray.server.name"

ROLLOUT_SPAN = "gym_ray.rollout"
JOB_SPAN = "gym_ray.job"

#: Seconds :func:`shutdown_tracing` and :meth:`Tracer.flush` wait for the exporters by default.
DEFAULT_FLUSH_TIMEOUT_S = 10.0

_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()
# The run id rollout spans carry when their row names none (set by :func:`run_scope`).


class RunMetrics:
    """A run's OpenTelemetry instruments: rollouts by outcome, rollout latency, rollouts in flight.

    ``gym_ray.rollouts`` (counter, attributes ``status`` and ``failure_class``),
    ``gym_ray.rollout.latency_ms`` (histogram, succeeded rollouts), ``gym_ray.rollouts.in_flight``
    (up-down counter). Fed per rollout by :meth:`Tracer.trace_rollout`, or from dispatch statistics with
    :meth:`observe` (any object with ``completed``, ``failed``, ``drained`` and ``in_flight`` counts).

    Args:
        meter: The meter to create the instruments on.
        reader: The metric reader, kept for :meth:`collect` (tests use ``InMemoryMetricReader``).
    """

    def __init__(self, meter: Meter, reader: MetricReader | None = None) -> None:
        self.reader = reader
        self._rollouts = meter.create_counter("gym_ray.rollouts", unit="1", description="rollouts by outcome")
        self._latency = meter.create_histogram(
            "gym_ray.rollout.latency_ms", unit="ms", description="wall time of successful rollouts"
        )
        self._in_flight = meter.create_up_down_counter(
            "gym_ray.rollouts.in_flight", unit="1", description="rollouts dispatched and not finished"
        )
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {"succeeded": 0, "failed": 0, "drained": 0, "in_flight": 0}

    def started(self) -> None:
        """One rollout started."""
        self._in_flight.add(1)

    def finished(self, status: str, failure_class: str | None, latency_ms: float) -> None:
        """One rollout finished with ``status`` (``succeeded|failed|drained|error``)."""
        self._in_flight.add(-1)
        attrs = (
            {"status": status}
            if failure_class is None
            else {"status": status, "failure_class": failure_class}
        )
        self._rollouts.add(1, attrs)
        if status == "succeeded":
            self._latency.record(latency_ms)

    def observe(self, stats: Any) -> None:
        """Feed counts from a dispatch statistics snapshot (e.g. ``DispatchStats``): adds the increase
        since the previous call. Use either this or per-rollout feeding for one dispatch, not both."""
        now = {
            "succeeded": int(stats.completed),
            "failed": int(stats.failed),
            "drained": int(stats.drained),
            "in_flight": int(stats.in_flight),
        }
        with self._lock:
            delta = {k: now[k] - self._seen[k] for k in now}
            self._seen = now
        for status in ("succeeded", "failed", "drained"):
            if delta[status] > 0:
                self._rollouts.add(delta[status], {"status": status})
        if delta["in_flight"]:
            self._in_flight.add(delta["in_flight"])

    def collect(self) -> dict[str, Any]:
        """``{metric name: [(attributes, value)]}`` from an in-memory reader (sums; histogram counts).

        Raises:
            ConfigError: The metrics were not set up with an in-memory reader.
        """
        if not isinstance(self.reader, InMemoryMetricReader):
            raise ConfigError(
                "RunMetrics.collect() needs the memory exporter; set tracing.exporter: memory",
                key=f"{TRACING_KEY}.exporter",
            )
        out: dict[str, Any] = {}
        data = self.reader.get_metrics_data()
        if data is None:
            return out
        for resource_metrics in data.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    points = out.setdefault(metric.name, [])
                    for point in metric.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value = point.count  # type: ignore[union-attr]
                        points.append((dict(point.attributes or {}), value))
        return out


class Tracer:
    """gym_ray's tracer: an OpenTelemetry tracer plus the settings (preset) and the optional metrics.

    Built by :func:`setup_tracing`. ``memory`` is the in-memory span exporter when the exporter is
    ``memory`` (``memory.get_finished_spans()``, ``memory.clear()``), else None.
    """

    def __init__(
        self,
        settings: TracingSettings,
        provider: TracerProvider,
        *,
        memory: InMemorySpanExporter | None = None,
        metrics: RunMetrics | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.settings = settings
        self.provider = provider
        self.otel = provider.get_tracer("gym_ray")
        self.groups = PRESETS[settings.preset]
        self.memory = memory
        self.metrics = metrics
        self.meter_provider = meter_provider

    def flush(self, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Export every finished span and the current metric values now; providers stay usable.

        Blocks up to ``timeout_s`` per provider (call it in a thread from async code when the exporter
        is ``otlp``). Returns False when an exporter did not finish in time (logged as a warning).
        """
        timeout_ms = int(timeout_s * 1000)
        flushed = self.provider.force_flush(timeout_ms)
        if self.meter_provider is not None:
            flushed = self.meter_provider.force_flush(timeout_ms) and flushed
        if not flushed:
            logger.warning(
                "tracing: the %s exporter did not finish exporting within %g s; spans or metric points "
                "may be lost",
                self.settings.exporter,
                timeout_s,
            )
        return flushed

    def job_links(self) -> tuple[Link, ...]:
        """Links to the job span current in this context (empty under ``per_rollout`` or without one)."""
        if "job" not in self.groups:
            return ()
        ctx = trace.get_current_span().get_span_context()
        return (Link(ctx),) if ctx.is_valid else ()

    async def trace_rollout(
        self,
        row: Mapping[str, Any],
        server: str | None,
        run: Callable[[Any], Awaitable[tuple[Any, Any]]],
        links: tuple[Link, ...] = (),
    ) -> tuple[Any, Any]:
        """Run one rollout's dispatch ``run(row)`` inside its own root span (see :func:`rollout_span`).

        The outcome (a result dict, :class:`CompletedRollout` or :class:`RolloutFailureRecord`) sets
        ``gym_ray.record.status`` (``succeeded|failed|drained``) and ``gym_ray.failure_class``; a raised
        error sets
        status ``error`` and is re-raised. Failures get the ERROR span status.
        """
        started = time.perf_counter()
        with rollout_span(self, row, server, links=links) as span:
            if self.metrics is not None:
                self.metrics.started()
            status, failure_class = "error", None
            try:
                out = await run(row)
                status, failure_class = _outcome_status(out[1])
                return out
            except Exception as exc:
                failure_class = _exception_failure_class(exc)
                span.record_exception(exc)
                raise
            finally:
                latency_ms = (time.perf_counter() - started) * 1000.0
                _finish_rollout(span, status, failure_class, latency_ms)
                if self.metrics is not None:
                    self.metrics.finished(status, failure_class, latency_ms)

    async def post_run(
        self,
        client: ServerClient,
        url: str,
        body: Any,
        *,
        retry_requests: bool,
        rollout_id: str | None = None,
        prior_attempts: int = 0,
    ) -> Any:
        """POST ``/run`` inside an ``HTTP POST`` CLIENT span (child of the current span) that sends W3C
        ``traceparent``; retries share the span. Errors propagate unchanged."""
        attrs: dict[str, Any] = {"http.request.method": "POST", "url.full": url + "/run"}
        if rollout_id is not None:
            attrs[ATTR_ROLLOUT_ID] = rollout_id
        with self.otel.start_as_current_span(
            "HTTP POST", kind=SpanKind.CLIENT, attributes=attrs, record_exception=False
        ) as span:
            headers: dict[str, str] = {}
            _PROPAGATOR.inject(headers)
            try:
                reply = await client.post_json(
                    url,
                    "/run",
                    body,
                    retry_requests=retry_requests,
                    headers=headers,
                    prior_attempts=prior_attempts,
                )
            except ServerHTTPError as exc:
                span.set_attribute("http.response.status_code", exc.status)
                span.set_status(Status(StatusCode.ERROR, f"HTTP {exc.status}"))
                raise
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
            span.set_attribute("http.response.status_code", 200)
            return reply

    @contextmanager
    def server_span(self, headers: Mapping[str, str], *, server: str, route: str) -> Iterator[Span]:
        """A SERVER span continuing the trace of an incoming request's ``traceparent`` (a new trace when
        absent). The caller sets ``http.response.status_code``; a status >= 500 sets ERROR (as does an
        exception leaving the block)."""
        parent = _PROPAGATOR.extract(dict(headers), context=_ROOT)
        with self.otel.start_as_current_span(
            f"POST {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={ATTR_SERVER_NAME: server, "http.route": route, "http.request.method": "POST"},
        ) as span:
            yield span
            attributes = getattr(span, "attributes", None) or {}
            code = attributes.get("http.response.status_code")
            if isinstance(code, int) and code >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))


@contextmanager
def rollout_span(
    tracer: Tracer, row: Mapping[str, Any], server: str | None, *, links: tuple[Link, ...] = ()
) -> Iterator[Span]:
    """The ROOT span of one rollout (a new trace), current while the block runs, linked to ``links``.

    Attributes set at start: ``gym_ray.task_index``, ``rollout_index``, ``attempt_index`` (0 when absent),
    ``rollout_id`` (when the row has one), ``environment_server``, ``run_id`` (the row's, else the one of
    the enclosing :func:`run_scope`). The caller finishes it with status / latency / failure class
    (:meth:`Tracer.trace_rollout` does). The span ends when the block exits.
    """
    attrs: dict[str, Any] = {ATTR_ATTEMPT_INDEX: 0}
    for key, attr in (
        (keys.TASK_INDEX, ATTR_TASK_INDEX),
        (keys.ROLLOUT_INDEX, ATTR_ROLLOUT_INDEX),
        (keys.ATTEMPT_INDEX, ATTR_ATTEMPT_INDEX),
        (keys.ROLLOUT_ID, ATTR_ROLLOUT_ID),
        (keys.RUN_ID, ATTR_RUN_ID),
    ):
        value = row.get(key)
        if isinstance(value, int | str) and not isinstance(value, bool):
            attrs[attr] = value
    if ATTR_RUN_ID not in attrs:
        run_id = _RUN_ID.get()
        if run_id is not None:
            attrs[ATTR_RUN_ID] = run_id
    if server is not None:
        attrs[ATTR_ENVIRONMENT_SERVER] = server
    span = tracer.otel.start_span(
        ROLLOUT_SPAN, context=_ROOT, links=links, attributes=attrs, record_exception=False
    )
    token = otel_context.attach(trace.set_span_in_context(span, _ROOT))
    try:
        yield span
    finally:
        otel_context.detach(token)
        span.end()


def _finish_rollout(span: Span, status: str, failure_class: str | None, latency_ms: float) -> None:
    span.set_attribute(ATTR_STATUS, status)
    span.set_attribute(ATTR_LATENCY_MS, latency_ms)
    if failure_class is not None:
        span.set_attribute(ATTR_FAILURE_CLASS, failure_class)
    if status in ("failed", "error"):
        span.set_status(Status(StatusCode.ERROR, failure_class or "error"))


def _outcome_status(outcome: Any) -> tuple[str, str | None]:
    if isinstance(outcome, RolloutFailureRecord):
        return "failed", outcome.failure_class
    result = outcome.result if isinstance(outcome, CompletedRollout) else outcome
    if not isinstance(result, Mapping):
        return "succeeded", None
    failure_class = result.get(keys.FAILURE_CLASS)
    if failure_class is None:
        return "succeeded", None
    if result.get(keys.DISPATCH_DRAINED):
        return "drained", str(failure_class)
    return "failed", str(failure_class)


def _exception_failure_class(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return failure_class_for_status(status if isinstance(status, int) else None)


@contextmanager
def job_span(tracer: Tracer | None, *, run_id: str | None = None, **attributes: Any) -> Iterator[Span | None]:
    """The run-scoped ``gym_ray.job`` span around a whole collection (current while the block runs).

    A no-op yielding None when ``tracer`` is None or its preset is ``per_rollout``. An exception leaving
    the block is recorded and sets the ERROR status. Rollout spans started inside link to it.
    """
    if tracer is None or "job" not in tracer.groups:
        yield None
        return
    attrs = {k: v for k, v in attributes.items() if isinstance(v, str | int | float | bool)}
    if run_id is not None:
        attrs[ATTR_RUN_ID] = run_id
    with tracer.otel.start_as_current_span(JOB_SPAN, kind=SpanKind.INTERNAL, attributes=attrs) as span:
        yield span


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span (e.g. the job span on the driver), or None."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


@contextmanager
def attach_traceparent(traceparent: str | None) -> Iterator[SpanContext | None]:
    """Make a remote span (the driver's job span, by its ``traceparent``) current for the block, without
    recording a span, so rollouts dispatched inside link to it. None or an invalid value attaches nothing."""
    if not traceparent:
        yield None
        return
    ctx = _PROPAGATOR.extract({"traceparent": traceparent}, context=_ROOT)
    span_context = trace.get_current_span(ctx).get_span_context()
    if not span_context.is_valid:
        yield None
        return
    token = otel_context.attach(ctx)
    try:
        yield span_context
    finally:
        otel_context.detach(token)


# --- set-up ------------------------------------------------------------------------------------------

_cache: SettingsCache[Tracer] = SettingsCache()


def setup_tracing(
    settings: TracingSettings,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Tracer | None:
    """The process's tracer for ``settings``, or None when tracing is off.

    Without explicit exporters the tracer is built once per process and settings and reused (call
    :func:`shutdown_tracing` to flush and forget). ``span_exporter`` / ``metric_reader`` build a fresh,
    uncached tracer that exports to them (tests, embedding). Providers are not installed globally.

    Raises:
        ConfigError: ``exporter: otlp`` without the ``opentelemetry-exporter-otlp`` package, or
            ``exporter: file`` without ``file_path``.
    """
    if not settings.enabled:
        return None
    if span_exporter is None and metric_reader is None:
        return _cache.get_or_build(settings, _build)
    return _build(settings, span_exporter, metric_reader)


def _build(
    settings: TracingSettings,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Tracer:
    built = build_providers(settings, span_exporter, metric_reader)
    metrics: RunMetrics | None = None
    if built.meter_provider is not None:
        metrics = RunMetrics(built.meter_provider.get_meter("gym_ray"), built.metric_reader)
    return Tracer(
        settings,
        built.provider,
        memory=built.memory,
        metrics=metrics,
        meter_provider=built.meter_provider,
    )


def setup_tracing_from_config(cfg: Mapping[str, Any]) -> Tracer | None:
    """:func:`setup_tracing` for a run config (its ``tracing:`` block and ``OTEL_*``); None when off.

    The call a Ray worker makes at start-up with the run config; cheap to repeat (cached per settings).

    Raises:
        ConfigError: See :meth:`TracingSettings.from_config` and :func:`setup_tracing`.
    """
    block = cfg.get(TRACING_KEY)
    if block is None or (isinstance(block, Mapping) and not block.get("enabled")):
        return None
    return setup_tracing(TracingSettings.from_config(cfg))


def shutdown_tracing(tracer: Tracer | None = None, *, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
    """Flush and shut down ``tracer``'s providers, or (None) every cached one, and forget them.

    The call every process that records telemetry makes before it ends (worker, driver, coordinator and
    stream-worker actors in their ``close()``, the CLI on exit): pending spans of batch processors and
    the last metric values of periodic readers are exported first, each provider waiting at most
    ``timeout_s`` (a slow exporter is logged, never raised). Blocking: from async code run it in a
    thread. Idempotent; a later :func:`setup_tracing` builds fresh providers.
    """
    if tracer is not None:
        targets = [tracer]
        _cache.forget(tracer)
    else:
        targets = _cache.drain()
    for target in targets:
        target.flush(timeout_s)
        target.provider.shutdown()
        if target.meter_provider is not None:
            target.meter_provider.shutdown(timeout_millis=timeout_s * 1000)

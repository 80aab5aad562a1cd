"""OpenTelemetry plumbing behind :mod:`gym_ray.observe.tracing`: exporters, providers, the cache.

What lives here: :class:`JsonlSpanExporter` (the ``file`` exporter), :func:`build_providers` (a tracer
provider and optional meter provider wired to the configured exporter) and :class:`SettingsCache` (one
object per process and settings). The ``tracing:`` settings are :mod:`gym_ray.config.tracing`.
:mod:`gym_ray.observe.tracing` is the public face and re-exports the public names; import them from there.

Concurrency: :class:`SettingsCache` serialises lookups and builds under one lock, so concurrent callers
with equal settings get the same object. :class:`JsonlSpanExporter` serialises its writes under a lock
within a process; across processes each export is one ``write`` on an ``O_APPEND`` descriptor, so lines do
not interleave on a local disk. Durability: span lines are neither flushed to stable storage nor fsynced
(spans are diagnostics; a crash may lose the last lines written).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gym_ray.config.tracing import TRACING_KEY, TracingSettings
from gym_ray.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "JsonlSpanExporter",
    "Providers",
    "SettingsCache",
    "build_providers",
]

_OTLP_MODULES = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)
_OTLP_METRIC_MODULES = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
)


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON line per finished span to ``path``; several processes may share the file.

    A line: ``name``, ``trace_id``/``span_id``/``parent_span_id`` (hex), ``links`` (``[{trace_id,
    span_id}]``), ``attributes``, ``status`` (``UNSET|OK|ERROR``), ``pid``. Each export is one ``write``
    on an ``O_APPEND`` descriptor, so lines from concurrent processes do not interleave on a local disk.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append ``spans`` (one line each)."""
        data = "".join(json.dumps(_span_line(span), separators=(",", ":")) + "\n" for span in spans)
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file (later exports fail)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _span_line(span: ReadableSpan) -> dict[str, Any]:
    ctx, parent = span.get_span_context(), span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "links": [
            {"trace_id": f"{x.context.trace_id:032x}", "span_id": f"{x.context.span_id:016x}"}
            for x in span.links
        ],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "pid": os.getpid(),
    }


# --- providers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Providers:
    """The OpenTelemetry objects built for one :class:`TracingSettings`.

    Attributes:
        provider: The tracer provider (not installed as the global provider).
        memory: The in-memory span exporter when spans go to one (``memory`` exporter, or an explicit
            ``InMemorySpanExporter``), else None.
        meter_provider: The meter provider when metrics are enabled and have a reader, else None.
        metric_reader: The reader of ``meter_provider`` (None exactly when ``meter_provider`` is None).
    """

    provider: TracerProvider
    memory: InMemorySpanExporter | None
    meter_provider: MeterProvider | None
    metric_reader: MetricReader | None


def _otlp_exporter(modules: tuple[str, ...], attr: str, endpoint: str | None, path: str) -> Any:
    """The first importable OTLP exporter class of ``modules``, built for ``endpoint`` (None: its
    ``OTEL_EXPORTER_OTLP_*`` environment). OTLP/HTTP posts to ``<endpoint>/v1/<signal>``; gRPC takes the
    endpoint as is."""
    for name in modules:
        try:
            cls = getattr(importlib.import_module(name), attr)
        except ImportError:
            continue
        if endpoint is None:
            return cls()
        if ".http." in name:
            return cls(endpoint=endpoint.rstrip("/") + path)
        return cls(endpoint=endpoint)
    raise ConfigError(
        "tracing.exporter = 'otlp' needs the OTLP exporter package, which is not installed; run "
        "`pip install opentelemetry-exporter-otlp` or choose exporter console|memory|none",
        key=f"{TRACING_KEY}.exporter",
    )


def build_providers(
    settings: TracingSettings,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Providers:
    """Build fresh providers for ``settings`` (no caching; see :class:`SettingsCache`).

    Args:
        settings: The tracing settings; ``exporter`` picks the span exporter and, when
            ``metrics_enabled``, the metric reader.
        span_exporter: Export spans here (synchronously) instead of to ``settings.exporter``.
        metric_reader: Read metrics with this instead of the reader ``settings.exporter`` implies
            (used only when ``settings.metrics_enabled``).

    Returns:
        The providers. Metrics are off (``meter_provider`` None) unless enabled and the exporter kind has
        a metric reader (``memory``, ``console``, ``otlp``) or ``metric_reader`` is given; enabled metrics
        that cannot be exported (``none``, ``file``) are logged as a warning here, at start.

    Raises:
        ConfigError: ``exporter: otlp`` without the ``opentelemetry-exporter-otlp`` package, or
            ``exporter: file`` without ``file_path``.
    """
    # process.pid tells the processes of a run apart (driver, each Ray worker) in any backend.
    resource = Resource.create({"service.name": settings.service_name, "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    memory: InMemorySpanExporter | None = None
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        memory = span_exporter if isinstance(span_exporter, InMemorySpanExporter) else None
    elif settings.exporter == "memory":
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    elif settings.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif settings.exporter == "otlp":
        otlp_spans = _otlp_exporter(_OTLP_MODULES, "OTLPSpanExporter", settings.otlp_endpoint, "/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(otlp_spans))
    elif settings.exporter == "file":
        if not settings.file_path:
            raise ConfigError(
                "tracing.exporter = 'file' needs tracing.file_path (the JSONL file spans are appended to); "
                "add e.g. tracing: {file_path: runs/r1/spans.jsonl}",
                key=f"{TRACING_KEY}.file_path",
            )
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(settings.file_path)))
    meter_provider: MeterProvider | None = None
    reader: MetricReader | None = None
    if settings.metrics_enabled:
        reader = metric_reader
        if reader is None:
            reader = _metric_reader(settings)
        if reader is not None:
            meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
        else:
            logger.warning(
                "tracing.metrics_enabled is true but exporter '%s' cannot export metrics: no metrics are "
                "recorded; use exporter otlp, console or memory for metrics",
                settings.exporter,
            )
    return Providers(provider, memory, meter_provider, reader)


def _metric_reader(settings: TracingSettings) -> MetricReader | None:
    interval_ms = settings.metrics_interval_s * 1000.0
    exporter: MetricExporter
    if settings.exporter == "memory":
        return InMemoryMetricReader()
    if settings.exporter == "console":
        exporter = ConsoleMetricExporter()
    elif settings.exporter == "otlp":
        exporter = _otlp_exporter(
            _OTLP_METRIC_MODULES, "OTLPMetricExporter", settings.otlp_endpoint, "/v1/metrics"
        )
    else:
        return None
    return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)


_T = TypeVar("_T")


class SettingsCache(Generic[_T]):
    """One object per :class:`TracingSettings` in this process (thread-safe).

    :mod:`gym_ray.observe.tracing` keeps its tracers here, so repeated set-up with equal settings (every Ray
    worker task, every server) reuses one provider instead of building another.
    """

    def __init__(self) -> None:
        self._items: dict[TracingSettings, _T] = {}
        self._lock = threading.Lock()

    def get_or_build(self, settings: TracingSettings, build: Callable[[TracingSettings], _T]) -> _T:
        """The cached object for ``settings``, built with ``build(settings)`` (under the lock) if absent.

        Raises:
            Exception: Whatever ``build`` raises; nothing is cached then.
        """
        with self._lock:
            hit = self._items.get(settings)
            if hit is None:
                hit = self._items[settings] = build(settings)
            return hit

    def forget(self, item: _T) -> None:
        """Drop every entry whose object is ``item`` (identity); absent is fine."""
        with self._lock:
            for key, value in list(self._items.items()):
                if value is item:
                    del self._items[key]

    def drain(self) -> list[_T]:
        """Remove and return every cached object."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
            return items

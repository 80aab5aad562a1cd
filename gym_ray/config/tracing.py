"""The ``tracing:`` block of a run config as a typed model, with the ``OTEL_*`` environment applied.

Read once at the edge with :meth:`TracingSettings.from_config` (part of :class:`gym_ray.config.RunConfig`);
:mod:`gym_ray.observe.tracing` builds the providers from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic import ValidationError as PydanticValidationError

from gym_ray.errors import ConfigError

__all__ = ["TRACING_KEY", "ExporterName", "Preset", "TracingSettings"]

#: Top-level run config key of the tracing block.
TRACING_KEY = "tracing"
Preset = Literal["default", "per_rollout"]
ExporterName = Literal["none", "console", "otlp", "memory", "file"]
_EXPORTERS = ("none", "console", "otlp", "memory", "file")


class TracingSettings(BaseModel):
    """The ``tracing:`` block of a run config.

    Attributes:
        enabled: Off by default; when off nothing is traced or measured.
        preset: ``default`` (job span + per-rollout traces + HTTP client spans) or ``per_rollout`` (no job
            span: each rollout is its own unlinked root trace).
        exporter: ``none`` (spans are made and propagated, not exported), ``console``, ``otlp`` (needs
            ``pip install opentelemetry-exporter-otlp``), ``memory`` (tests; see
            :attr:`gym_ray.observe.tracing.Tracer.memory`) or ``file`` (one JSON line per span appended to
            ``file_path`` by every process, Ray workers included; see :class:`JsonlSpanExporter`).
        file_path: The span file of the ``file`` exporter (required by it). A relative path is made
            absolute where the settings are read (where the run or the server starts), so that every
            Ray actor, whatever its working directory, appends to the same file.
        service_name: The ``service.name`` resource attribute.
        metrics_enabled: Also export :class:`gym_ray.observe.tracing.RunMetrics` through the same exporter
        kind.
        metrics_interval_s: Export interval of periodic metric exporters (console, otlp).
        otlp_endpoint: Base URL of the OTLP receiver (``http://collector:4318`` for OTLP/HTTP, which
            posts to ``/v1/traces`` and ``/v1/metrics`` under it); None lets the exporter read
            ``OTEL_EXPORTER_OTLP_*`` in each process. Set in the config (or ``OTEL_EXPORTER_OTLP_ENDPOINT``
            where the run starts), it is shipped to every Ray actor with the run config.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    enabled: bool = False
    preset: Preset = "default"
    exporter: ExporterName = "none"
    service_name: str = "gym-ray"
    metrics_enabled: bool = False
    metrics_interval_s: float = 60.0
    file_path: str | None = None
    otlp_endpoint: str | None = None

    @field_validator("file_path")
    @classmethod
    def _absolute_file_path(cls, value: str | None) -> str | None:
        return os.path.abspath(value) if value else value

    @classmethod
    def from_config(
        cls, cfg: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
    ) -> TracingSettings:
        """Read ``cfg["tracing"]`` (absent = defaults), then apply the ``OTEL_*`` environment variables.

        Raises:
            ConfigError: The block is not a mapping, has an unknown key, or a value of the wrong type or
                outside the allowed values (``key`` is ``tracing.<field>``); or ``OTEL_TRACES_EXPORTER``
                names an unsupported exporter.
        """
        env = os.environ if environ is None else environ
        block = cfg.get(TRACING_KEY)
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            raise ConfigError(
                f"{TRACING_KEY} = {block!r:.80} is not a mapping; write e.g. "
                "tracing: {enabled: true, exporter: console}",
                key=TRACING_KEY,
            )
        data = dict(block)
        exporter = env.get("OTEL_TRACES_EXPORTER")
        if exporter:
            exporter = exporter.strip().lower()
            if exporter not in _EXPORTERS:
                raise ConfigError(
                    f"OTEL_TRACES_EXPORTER={exporter!r} is not supported by gym_ray; use one of "
                    f"{', '.join(_EXPORTERS)} (a single value)",
                    key="OTEL_TRACES_EXPORTER",
                )
            data["exporter"] = exporter
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint:
            data["otlp_endpoint"] = endpoint.strip()
        service = env.get("OTEL_SERVICE_NAME")
        if service:
            data["service_name"] = service
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            data["enabled"] = False
        try:
            return cls.model_validate(data)
        except PydanticValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise ConfigError(
                f"{TRACING_KEY}.{field} = {err.get('input')!r:.80}: {err['msg']}; allowed keys: "
                f"{', '.join(cls.model_fields)} (preset: default|per_rollout, exporter: "
                f"{'|'.join(_EXPORTERS)})",
                key=f"{TRACING_KEY}.{field}",
            ) from exc

"""Tracing where a run turns it on, and OpenTelemetry left unimported where it does not.

:mod:`gym_ray.observe.tracing` imports the OpenTelemetry SDK at module level: 0.3-1 s of start-up CPU and
about 20 MB in every process that loads it. Tracing is off by default, so every place a run touches
tracing goes through these functions instead: the single-process run, the Ray caller, the worker actors
and the host actor (driver and coordinator). Each one imports :mod:`gym_ray.observe.tracing` only when
the run's settings turn tracing on, or (:func:`shutdown_tracing_if_used`) when this process already
loaded it.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gym_ray.config.tracing import TracingSettings
    from gym_ray.observe.tracing import Tracer

__all__ = ["job_span_for", "shutdown_tracing_if_used", "tracer_for", "under_traceparent"]

_TRACING = "gym_ray.observe.tracing"


def tracer_for(settings: TracingSettings) -> Tracer | None:
    """This process's tracer for ``settings`` (:func:`gym_ray.observe.tracing.setup_tracing`), or None
    when tracing is off, without importing OpenTelemetry."""
    if not settings.enabled:
        return None
    from gym_ray.observe.tracing import setup_tracing

    return setup_tracing(settings)


def job_span_for(
    tracer: Tracer | None, *, run_id: str | None = None, **attributes: Any
) -> AbstractContextManager[Any]:
    """:func:`gym_ray.observe.tracing.job_span` (yields the span, or None), or a no-op yielding None
    without a tracer."""
    if tracer is None:
        return nullcontext()
    from gym_ray.observe.tracing import job_span

    return job_span(tracer, run_id=run_id, **attributes)


def under_traceparent(traceparent: str | None) -> AbstractContextManager[Any]:
    """:func:`gym_ray.observe.tracing.attach_traceparent`, or a no-op when there is no parent to attach
    (tracing off on the caller's side)."""
    if not traceparent:
        return nullcontext()
    from gym_ray.observe.tracing import attach_traceparent

    return attach_traceparent(traceparent)


def shutdown_tracing_if_used() -> None:
    """:func:`gym_ray.observe.tracing.shutdown_tracing` when this process loaded tracing; else nothing.

    A process that never imported :mod:`gym_ray.observe.tracing` has set up no provider, so it has
    nothing to flush. Blocking (bounded by the exporters' flush timeout): from async code run it in a
    thread.
    """
    tracing = sys.modules.get(_TRACING)
    if tracing is not None:
        tracing.shutdown_tracing()

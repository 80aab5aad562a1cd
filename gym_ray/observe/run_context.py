"""The run a task works for, as a context variable: rollout spans carry its id (``gym_ray.run_id``).

Kept apart from :mod:`gym_ray.observe.tracing` so that a run sets it without importing OpenTelemetry:
a run with tracing off never loads the SDK. :func:`run_scope` is re-exported there.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RUN_ID", "run_scope"]

#: The current run's id (None outside :func:`run_scope`).
RUN_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("gym_ray_trace_run_id", default=None)


@contextmanager
def run_scope(run_id: str | None) -> Iterator[None]:
    """Rollout spans started in this block (and in tasks created inside it) carry ``gym_ray.run_id``
    = ``run_id`` unless their row names its own. None sets nothing. Cheap: one context variable."""
    if run_id is None:
        yield
        return
    token = RUN_ID.set(run_id)
    try:
        yield
    finally:
        RUN_ID.reset(token)

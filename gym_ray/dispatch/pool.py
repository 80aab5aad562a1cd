"""The HTTP client pool of one process of a run, sized from the run's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gym_ray.dispatch.client import ServerClient

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig

__all__ = ["client_for"]


def client_for(run: RunConfig) -> ServerClient:
    """The client pool of one process (a worker's, the coordinator's for ``/aggregate_metrics``, a
    single-process run's): ``max_connections``, the timeouts and ``retry_requests`` of the run's settings."""
    settings = run.settings
    return ServerClient(
        run.topology,
        max_connections=settings.max_connections,
        connect_timeout_s=settings.connect_timeout_s,
        request_timeout_s=settings.request_timeout_s,
        retry_requests=settings.retry_requests,
    )

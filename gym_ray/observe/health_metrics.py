"""OpenTelemetry metrics of server health: is each environment server up, how often and how long it was
down, how many infrastructure failures it cost.

Instruments (attribute ``server``: the instance name), on the run's meter provider (the ``tracing:`` block
with ``metrics_enabled: true`` and an exporter that sends metrics; see :mod:`gym_ray.observe.tracing`):

- ``gym_ray.server.up`` (gauge, 1 or 0): 1 from the first request to the server, 0 while it looks down
  (its rows held back) and after an outage stopped the run, 1 again when a probe finds it back.
- ``gym_ray.server.outages`` (counter): times the server was judged down.
- ``gym_ray.server.down_s`` (counter, seconds): length of each outage, from the first failure of the
  streak that made it look down to its return (or to the outage timeout), added when the outage ends.
- ``gym_ray.server.infra_failures`` (counter): infrastructure failures (connection refused or reset,
  timeout, 429/502/503/504), each resent apart from ``max_rollout_attempts`` while its budget lasts.

Each process keeps its own :class:`~gym_ray.dispatch.health.ServerHealth` (one per Ray worker), so on a
distributed run each worker process reports its own points (resource attribute ``process.pid``): a backend
sums the counters and takes the minimum of ``up`` across processes.

Concurrency: :class:`HealthMetrics` is called on the health object's event loop; the OpenTelemetry SDK's
instruments are thread-safe against the reader that collects them.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter
    from opentelemetry.sdk.metrics import MeterProvider

    from gym_ray.observe.tracing import Tracer

__all__ = ["HEALTH_METRICS", "HealthMetrics", "health_metrics"]

#: The instruments' names, in the order of the module docstring.
HEALTH_METRICS = (
    "gym_ray.server.up",
    "gym_ray.server.outages",
    "gym_ray.server.down_s",
    "gym_ray.server.infra_failures",
)


class HealthMetrics:
    """The health instruments on one meter; a :class:`~gym_ray.dispatch.health.HealthListener`.

    Args:
        meter: The meter the instruments are created on (once per meter: use :func:`health_metrics`).
    """

    def __init__(self, meter: Meter) -> None:
        up, outages, down_s, infra = HEALTH_METRICS
        self._up = meter.create_gauge(
            up, unit="1", description="1 while the server answers, 0 while it looks down"
        )
        self._outages = meter.create_counter(
            outages, unit="1", description="times the server was judged down"
        )
        self._down_s = meter.create_counter(
            down_s, unit="s", description="seconds of outage, added when one ends"
        )
        self._infra = meter.create_counter(
            infra,
            unit="1",
            description="infrastructure failures of /run (resent apart from rollout attempts)",
        )

    def infra_failure(self, server: str) -> None:
        """Count one infrastructure failure of ``server``."""
        self._infra.add(1, {"server": server})

    def down(self, server: str) -> None:
        """``server`` looks down: ``up`` 0, one more outage."""
        attrs = {"server": server}
        self._up.set(0, attrs)
        self._outages.add(1, attrs)

    def up(self, server: str, down_s: float) -> None:
        """``server`` answers (first sight, or back after ``down_s`` seconds of outage)."""
        attrs = {"server": server}
        self._up.set(1, attrs)
        if down_s > 0:
            self._down_s.add(down_s, attrs)

    def outage(self, server: str, down_s: float) -> None:
        """``server`` stayed down past the timeout: ``up`` stays 0, the outage's ``down_s`` is added."""
        attrs = {"server": server}
        self._up.set(0, attrs)
        self._down_s.add(down_s, attrs)


_by_provider: weakref.WeakKeyDictionary[MeterProvider, HealthMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def health_metrics(tracer: Tracer | None) -> HealthMetrics | None:
    """The health instruments of ``tracer``'s meter provider (created once per provider), or None when
    metrics are off (no tracer, or tracing without ``metrics_enabled`` / a metric exporter)."""
    provider = None if tracer is None else tracer.meter_provider
    if provider is None:
        return None
    with _lock:
        hit = _by_provider.get(provider)
        if hit is None:
            hit = _by_provider[provider] = HealthMetrics(provider.get_meter("gym_ray"))
        return hit

"""What a stream did, for a trainer's step logs: :class:`StreamStats` and the :class:`StepMeter` behind it.

The meter counts what the stream's RL features do (stale rollouts re-run, rollouts aborted by a pause,
groups filtered by reason, groups carried over or cancelled at a batch's end, time paused), the staleness
of every delivered rollout, and the ``/run`` latency of delivered results per environment server. The same
figures go to OpenTelemetry through the global meter provider (``opentelemetry.metrics``; a no-op unless
the process installed one) as instruments named ``gym_ray.stream.*``.

Concurrency: a meter belongs to its stream's event loop (no locks).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gym_ray import keys

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

__all__ = ["StepMeter", "StreamStats"]


@dataclass(frozen=True)
class StreamStats:
    """A snapshot of a stream.

    Attributes:
        read: Rollout rows read from the input (after ``group_size`` expansion and resume skips).
        skipped: Rollout rows skipped because ``record_dir`` already holds them (``resume=True``).
        delivered: Outcomes handed to the consumer (a group counts ``group_size``).
        buffered: Outcomes waiting in the buffer (complete groups only).
        queued: Rows waiting for a worker.
        at_workers: Rows submitted to a worker and not yet pulled back.
        requeued: Rows re-queued after their worker died.
        workers_lost: Workers that died.
        policy_version: The current policy version.
        paused: Admission is paused now.
        paused_s: Seconds spent paused so far (the current pause included).
        aborted: Rollouts whose ``/run`` was cancelled by ``pause(mode="abort")`` (each runs again).
        stale: Rollouts not delivered because they were more than ``max_staleness`` versions old (each
            runs again under the current version).
        retried: Rollouts the server answered with a failure that ran again (``max_rollout_attempts``).
        filtered: Groups dropped by a group filter, by the filter's name.
        carried_over: Groups still running at the end of a ``next_batch(carry_over=True)`` (summed over
            batches; a group running through two batch ends counts twice).
        cancelled: Groups cancelled at the end of a ``next_batch(carry_over=False)``.
        staleness: Delivered rollouts by staleness at delivery (current version - their version).
        rollouts_per_s: Delivered rollouts per second since the workers started (Ray's start and the
            config's checks left out).
        server_latency_ms: Mean ``/run`` wall time of delivered results, by environment server.
        run_ahead: The run-ahead window in rollouts (read and not yet delivered, at most), set by
            ``next_batch`` from ``max_staleness``: ``(max_staleness + 1) x`` the batch's groups
            (``oversample`` included) ``x group_size``; None without ``max_staleness`` or before the first
            ``next_batch`` (no window: the stream reads ahead as bounded by ``max_in_flight`` and the buffer).
    """

    read: int
    skipped: int
    delivered: int
    buffered: int
    queued: int
    at_workers: int
    requeued: int
    workers_lost: int
    policy_version: int = 0
    paused: bool = False
    paused_s: float = 0.0
    aborted: int = 0
    stale: int = 0
    retried: int = 0
    filtered: dict[str, int] = field(default_factory=dict)
    carried_over: int = 0
    cancelled: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    rollouts_per_s: float = 0.0
    server_latency_ms: dict[str, float] = field(default_factory=dict)
    run_ahead: int | None = None


class StepMeter:
    """The counters behind the RL fields of :class:`StreamStats`, mirrored to OpenTelemetry.

    Args:
        run_id: The stream's run id (an attribute of every OTel data point).
        clock: Seconds, monotonic (injected for tests).
        meter: The OTel meter (default: ``gym_ray.streaming`` from the global meter provider).
    """

    def __init__(
        self, run_id: str, *, clock: Callable[[], float] = time.monotonic, meter: Meter | None = None
    ) -> None:
        from opentelemetry import metrics

        self._clock = clock
        self._attrs = {"gym_ray.run_id": run_id}
        self.started = clock()
        self.paused_since: float | None = None
        self.paused_s = 0.0
        self.aborted = self.stale = self.retried = self.carried_over = self.cancelled = 0
        self.filtered: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()
        self._latency: dict[str, tuple[int, float]] = {}
        meter = meter if meter is not None else metrics.get_meter("gym_ray.streaming")
        self._otel_counts: dict[str, Any] = {
            name: meter.create_counter(f"gym_ray.stream.{name}", unit="1", description=text)
            for name, text in (
                ("delivered", "rollouts delivered"),
                ("aborted", "rollouts aborted by pause(mode='abort')"),
                ("stale", "rollouts re-run because they exceeded max_staleness"),
                ("retried", "failed rollouts re-run under max_rollout_attempts"),
                ("filtered", "groups dropped by a group filter, by reason"),
                ("carried_over", "groups running at a batch end that carried over"),
                ("cancelled", "groups cancelled at a batch end"),
            )
        }
        self._otel_paused = meter.create_counter("gym_ray.stream.paused", unit="s", description="time paused")
        self._otel_staleness = meter.create_histogram(
            "gym_ray.stream.staleness", unit="1", description="versions behind current at delivery"
        )
        self._otel_latency = meter.create_histogram(
            "gym_ray.stream.rollout_latency", unit="ms", description="/run wall time of delivered results"
        )

    def count(self, name: str, n: int = 1, *, reason: str | None = None) -> None:
        """Add ``n`` to ``aborted`` / ``stale`` / ``retried`` / ``carried_over`` / ``cancelled``, or to
        ``filtered[reason]``."""
        if n <= 0:
            return
        if name == "filtered":
            self.filtered[reason or "filtered"] += n
            self._otel_counts[name].add(n, {**self._attrs, "reason": reason or "filtered"})
            return
        setattr(self, name, getattr(self, name) + n)
        self._otel_counts[name].add(n, self._attrs)

    def pause(self) -> None:
        """Admission stopped now (no-op when already paused)."""
        if self.paused_since is None:
            self.paused_since = self._clock()

    def resume(self) -> None:
        """Admission restarted now (no-op when not paused)."""
        if self.paused_since is not None:
            spent = self._clock() - self.paused_since
            self.paused_since = None
            self.paused_s += spent
            self._otel_paused.add(spent, self._attrs)

    def paused_total_s(self) -> float:
        """Seconds paused so far, the current pause included."""
        now = self._clock()
        return self.paused_s + (0.0 if self.paused_since is None else now - self.paused_since)

    def delivered(self, items: Iterable[tuple[Mapping[str, Any], Any]], current: int) -> None:
        """Count delivered ``(row, outcome)`` pairs: staleness and per-server latency."""
        n = 0
        for row, outcome in items:
            n += 1
            behind = current - int(row[keys.POLICY_VERSION])
            self.staleness[behind] += 1
            self._otel_staleness.record(behind, self._attrs)
            if not isinstance(outcome, dict):
                continue
            perf = outcome.get(keys.NG_PERF)
            latency = perf.get("total_latency_ms") if isinstance(perf, dict) else None
            server = outcome.get(keys.ENVIRONMENT_SERVER)
            if isinstance(latency, int | float) and isinstance(server, str):
                count, total = self._latency.get(server, (0, 0.0))
                self._latency[server] = (count + 1, total + float(latency))
                self._otel_latency.record(float(latency), {**self._attrs, "server": server})
        self._otel_counts["delivered"].add(n, self._attrs)

    def begin(self) -> None:
        """The workers run from now on: the rate counts from here, not from Ray's start."""
        self.started = self._clock()

    def rate(self, delivered: int) -> float:
        """Delivered rollouts per second since the workers started (:meth:`begin`)."""
        elapsed = self._clock() - self.started
        return delivered / elapsed if elapsed > 0 else 0.0

    def server_latency_ms(self) -> dict[str, float]:
        """Mean ``/run`` wall time of delivered results, by environment server."""
        return {server: total / count for server, (count, total) in sorted(self._latency.items())}

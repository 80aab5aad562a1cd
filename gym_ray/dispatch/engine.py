"""Dispatch: POST every row's ``/run`` to its environment server and classify what comes back.

The engine behind :meth:`RolloutCollectionHelper.run_examples`, :func:`run_outcomes` and collection
(:func:`dispatch`). Concurrency promises (see :mod:`gym_ray.dispatch._completion`): one task per row, lazy
bounded admission under ``max_resident_tasks``, the caller's semaphore acquired inside the row's task (FIFO,
so rows start in input order), every task owned and joined by ``aclose()`` / ``aclose_and_drain()``.

The hot path sends a row as it is (no copy) and logs nothing per row. A dispatch budget
(``dispatch_budget_s``) is measured from the call that built the dispatcher; a row whose turn comes after
the budget, or with less time left than the drain margin (explicit, else the p75 of observed successful
``/run`` latencies once 5 exist), is not sent and resolves to
:func:`~gym_ray.dispatch.outcomes.drained_result`.

With a :class:`~gym_ray.dispatch.health.ServerHealth` (collection runs and streams pass one), the engine
is the only retry ladder of a ``/run``: the HTTP client sends each request once (it still retries a
connection that could not be made, which sent nothing) and every request the server may have seen is
counted in the row's failure record (``_ng_failure_requests``, ``_ng_failure_request_errors``):

- a timeout of a server that still answers a probe (``GET /``) is the rollout's: replayed (when
  ``retry_requests``) up to the client's ``max_request_retries`` times, then its failure record. The worst
  case from a hung ``/run`` to its record is about ``request_timeout_s x (max_request_retries + 1)`` plus
  the backoffs (under 1.5 s with the defaults) and the probes;
- any other infrastructure failure (see :func:`~gym_ray.dispatch.health.is_infrastructure_failure`), and a
  timeout of a server that does not answer its probe, is not a failure record: the row waits until its
  server is admitted again and is resent, up to ``max_infra_retries`` times; only then does the last error
  become its failure record.

Resends wait a jittered backoff (the client's, capped at :data:`RESEND_BACKOFF_CAP_S`) and take the
semaphore per attempt, so a row waiting for a down server or a backoff holds no slot.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch._completion import CompletionIterator
from gym_ray.dispatch._http import excerpt_of
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.health import ServerHealth
from gym_ray.dispatch.ladder import CANCELLED, RESEND_BACKOFF_CAP_S, Ladder, SendFailed, request_error
from gym_ray.dispatch.outcomes import (
    CompletedRollout,
    RolloutFailureRecord,
    build_record,
    classify_reply,
    drained_result,
    is_expected_failure,
    is_materialized_row,
)
from gym_ray.errors import InputError, ServerHTTPError, ServerResponseError

if TYPE_CHECKING:
    from gym_ray.observe.tracing import Tracer

__all__ = [
    "CompletionIterator",
    "DispatchIterator",
    "DispatchStats",
    "LatencyTracker",
    "dispatch",
    "episode_request_body",
]

R = TypeVar("R")
T = TypeVar("T")
Row = dict[str, Any]
#: ``(row, failure_row)`` -> None or an awaitable; called for an unrouted failure before it is raised.
FailureRecorder = Callable[[Row, Row], Awaitable[None] | None]
#: Called with a row just before its ``/run`` is sent (each send, retries too); an exception it raises is
#: the row's outcome and nothing is sent (collection announces the attempt in the shard's attempt log).
BeforeSend = Callable[[Row], None]
Shape = Literal["examples", "completed", "outcomes"]

#: Successful latencies before the adaptive drain margin (p75) applies.
DRAIN_MARGIN_MIN_SAMPLES = 5
#: Rows per round-robin window of ``interleave_by_agent`` (keeps memory bounded for any input size).
INTERLEAVE_WINDOW = 4096
#: Resends of one row after infrastructure failures of a server that still looked up (default).
DEFAULT_MAX_INFRA_RETRIES = 10


@dataclass(frozen=True, slots=True)
class DispatchStats:
    """A snapshot of one dispatch.

    Attributes:
        in_flight: Rows admitted and not finished.
        admitted: Rows that became tasks.
        drained: Rows not sent because of the dispatch budget.
        failed: Rows whose ``/run`` failed or whose reply was classified as a failure.
        completed: Rows with a result.
        p50_latency_ms: Median successful ``/run`` latency, None before the first one.
        p99_latency_ms: p99 of the same.
    """

    in_flight: int
    admitted: int
    drained: int
    failed: int
    completed: int
    p50_latency_ms: float | None
    p99_latency_ms: float | None


class LatencyTracker:
    """Latencies of successful ``/run`` calls (seconds) and the adaptive drain margin.

    Exact (sorted samples, linear interpolation at ``(n-1)*q``) for the first ``exact_limit`` samples;
    beyond that a log histogram with 1 % wide buckets keeps memory constant (quantiles within ~1 %).
    """

    def __init__(self, *, exact_limit: int = 4096) -> None:
        self._exact_limit = exact_limit
        self._sorted: list[float] = []
        self._buckets: dict[int, int] = {}
        self._count = 0
        self._margin: float | None = None
        self._margin_at = 0

    @property
    def count(self) -> int:
        """Samples recorded."""
        return self._count

    def record(self, seconds: float) -> None:
        """Record one successful latency; non-positive values are ignored."""
        if seconds <= 0:
            return
        self._count += 1
        if self._buckets or len(self._sorted) >= self._exact_limit:
            if not self._buckets:
                for value in self._sorted:
                    self._bucket_add(value)
                self._sorted = []
            self._bucket_add(seconds)
        else:
            bisect.insort(self._sorted, seconds)

    def _bucket_add(self, seconds: float) -> None:
        index = math.floor(math.log(seconds) / math.log1p(0.01))
        self._buckets[index] = self._buckets.get(index, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile in seconds, or None without samples."""
        if self._sorted:
            data = self._sorted
            pos = (len(data) - 1) * q
            low = math.floor(pos)
            high = min(low + 1, len(data) - 1)
            return data[low] + (data[high] - data[low]) * (pos - low)
        if not self._buckets:
            return None
        target = (self._count - 1) * q
        seen = 0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if seen > target:
                return float(math.exp((index + 0.5) * math.log1p(0.01)))
        return float(math.exp((max(self._buckets) + 0.5) * math.log1p(0.01)))

    def drain_margin(self, configured_s: float | None) -> float | None:
        """The margin in force: ``configured_s`` when given, else p75 once 5 samples exist, else None."""
        if configured_s is not None:
            return configured_s
        if self._count < DRAIN_MARGIN_MIN_SAMPLES:
            return None
        # Recompute while exact; in histogram mode every 64 samples (cheap enough for the hot path).
        stale = self._count != self._margin_at and (bool(self._sorted) or self._count % 64 == 0)
        if self._margin is None or stale:
            self._margin = self.quantile(0.75)
            self._margin_at = self._count
        return self._margin


def episode_request_body(row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/run`` body of a materialized task row: ``{"episode_id": {...}, "task": {...}}``.

    ``rollout_id`` is the row's ``_ng_rollout_id``, else ``"<task>-<rollout>"`` (attempt not included);
    ``attempt`` is ``_ng_attempt_index`` (0 when absent).

    Raises:
        InputError: The attempt is not a non-negative int, or the row has neither a rollout id nor
            task and rollout indices.
    """
    attempt = row.get(keys.ATTEMPT_INDEX)
    if attempt is None:
        attempt = 0
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise InputError(
            f"materialized row {dict(row.get(keys.TASK_ID) or {})} has {keys.ATTEMPT_INDEX}={attempt!r}; "
            "it must be an int >= 0 (leave it out on a first attempt)"
        )
    rollout_id = row.get(keys.ROLLOUT_ID)
    if not isinstance(rollout_id, str) or not rollout_id:
        task, rollout = row.get(keys.TASK_INDEX), row.get(keys.ROLLOUT_INDEX)
        if not isinstance(task, int) or not isinstance(rollout, int):
            raise InputError(
                f"materialized row {dict(row.get(keys.TASK_ID) or {})} has no {keys.ROLLOUT_ID} and no "
                f"{keys.TASK_INDEX}/{keys.ROLLOUT_INDEX} ({task!r}, {rollout!r}); run preprocess_examples "
                "first or give it an explicit rollout id"
            )
        rollout_id = keys.default_rollout_id(task, rollout)
    return {
        keys.EPISODE_ID: {keys.EPISODE_ROLLOUT_ID: rollout_id, keys.EPISODE_ATTEMPT: attempt},
        keys.TASK: {keys.TASK_ID: row[keys.TASK_ID], keys.TASK_INPUT: row[keys.TASK_INPUT]},
    }


def _agent_key(row: Mapping[str, Any]) -> Any:
    ref = row.get(keys.AGENT_REF)
    agent = ref.get("name") if isinstance(ref, Mapping) else None
    if agent is not None:
        return agent
    task_id = row.get(keys.TASK_ID)
    if isinstance(task_id, Mapping):
        return ("taskset", task_id.get(keys.TASKSET))
    return ("server", row.get(keys.ENVIRONMENT_SERVER))


def interleave_by_agent(rows: Iterable[R]) -> Iterator[R]:
    """Round-robin rows across agents, (:data:`INTERLEAVE_WINDOW` rows; order kept per agent)."""
    it = iter(rows)
    while True:
        window: dict[Any, list[R]] = {}
        taken = 0
        for row in it:
            window.setdefault(_agent_key(row) if isinstance(row, Mapping) else None, []).append(row)
            taken += 1
            if taken >= INTERLEAVE_WINDOW:
                break
        if not taken:
            return
        queues = [iter(group) for group in window.values()]
        while queues:
            alive = []
            for queue in queues:
                for row in queue:
                    yield row
                    alive.append(queue)
                    break
            queues = alive


class _Dispatcher:
    """What one row's task does: route, drain check, POST, classify. Shared by every row of a dispatch."""

    def __init__(
        self,
        client: ServerClient,
        topology: Topology,
        *,
        shape: Shape,
        semaphore: asyncio.Semaphore | None,
        dispatch_budget_s: float | None,
        drain_margin_s: float | None,
        route_failures_to_sidecar: bool,
        record_unrouted_failures: bool,
        record_failure: FailureRecorder | None,
        retry_requests: bool,
        clock: Callable[[], float],
        tracer: Tracer | None = None,
        health: ServerHealth | None = None,
        max_infra_retries: int = DEFAULT_MAX_INFRA_RETRIES,
        before_send: BeforeSend | None = None,
    ) -> None:
        self.client = client
        self.before_send = before_send
        self.health = health
        self.max_infra_retries = max_infra_retries
        self.tracer = tracer
        # Links to the job span current where the dispatch is built (none when off / per_rollout).
        self.trace_links = () if tracer is None else tracer.job_links()
        self.topology = topology
        self.shape = shape
        self.semaphore = semaphore
        self.clock = clock
        self.deadline = None if dispatch_budget_s is None else clock() + dispatch_budget_s
        self.drain_margin_s = drain_margin_s
        self.route = route_failures_to_sidecar
        self.record_unrouted = record_unrouted_failures
        self.record_failure = record_failure
        self.retry_requests = retry_requests
        self.tracker = LatencyTracker()
        self.drained = self.failed = self.completed = 0
        self._routes: dict[Any, tuple[str, str, str | None]] = {}

    def server_of(self, row: Mapping[str, Any]) -> tuple[str, str, str | None]:
        """``(server name, base URL, implementation)`` for a row, cached per stamp / taskset / agent."""
        stamp = row.get(keys.ENVIRONMENT_SERVER)
        key: Any = stamp if isinstance(stamp, str) else _agent_key(row)
        hit = self._routes.get(key)
        if hit is None:
            name = stamp if isinstance(stamp, str) else self.topology.environment_server_for_row(row)
            if isinstance(stamp, str):
                self.topology.environment_server_for_row({keys.ENVIRONMENT_SERVER: stamp})  # known server?
            inst = self.topology.instances.get(name)
            hit = (name, self.topology.url_of(name), inst.implementation if inst is not None else None)
            self._routes[key] = hit
        return hit

    async def run(self, row: Row, ladder: Ladder | None = None) -> tuple[Row, Any]:
        """One row's task body (the semaphore, when any, is held for the drain check and the request).

        ``ladder``: the row's retry ladder so far, for a row run again after its task was cancelled (a
        stream's ``pause("abort")``): its budgets go on instead of starting again (with a health object).
        """
        if self.semaphore is None or self.health is not None:
            return await self._run(row, ladder)
        async with self.semaphore:
            return await self._run(row, ladder)

    def new_ladder(self) -> Ladder:
        """An empty retry ladder for one row (see :meth:`run`)."""
        return Ladder(self.client.max_request_retries)

    async def _run(self, row: Row, ladder: Ladder | None) -> tuple[Row, Any]:
        if self.tracer is None:
            return await self._run_row(row, ladder)
        run_row = functools.partial(self._run_row, ladder=ladder)
        return await self.tracer.trace_rollout(row, self.server_of(row)[0], run_row, self.trace_links)

    async def _run_row(self, row: Row, ladder: Ladder | None = None) -> tuple[Row, Any]:
        health = self.health
        if health is None:
            out: tuple[Row, Any] = await self._attempt(row, None)
            return out
        server, url, _ = self.server_of(row)
        if ladder is None:
            ladder = self.new_ladder()
        while True:
            await health.admit(url, server)
            slot = self.semaphore if self.semaphore is not None else contextlib.nullcontext()
            async with slot:
                out = await self._attempt(row, ladder)
            if not isinstance(out, SendFailed):
                return out
            exc = out.exc
            if not await ladder.resend(exc, url, server, health, self.retry_requests, self.max_infra_retries):
                return await self._failed(row, exc, server, ladder)
            if not (isinstance(exc, ServerHTTPError) and exc.retry_after_s is not None):
                # (a Retry-After pauses the server's admission instead)
                await self.client.sleep(
                    self.client.backoff.delay(ladder.resends - 1, cap_s=RESEND_BACKOFF_CAP_S)
                )

    async def _attempt(self, row: Row, ladder: Ladder | None) -> Any:
        server, url, impl = self.server_of(row)
        if self.deadline is not None:
            remaining = self.deadline - self.clock()
            margin = self.tracker.drain_margin(self.drain_margin_s)
            if remaining <= 0 or (margin is not None and remaining < margin):
                self.drained += 1
                return self._drained(row, drained_result(remaining, margin), server, impl)
        if self.before_send is not None:
            self.before_send(row)
        body = episode_request_body(row) if is_materialized_row(row) else row
        # on the ladder the engine alone resends a /run the server may have seen
        replay = self.retry_requests if ladder is None else False
        sent = 0
        if ladder is not None:  # counted as it leaves: a send cancelled meanwhile (an abort) stays counted
            sent = len(ladder.errors)
            ladder.errors.append(CANCELLED)
        started = time.perf_counter()
        try:
            if self.tracer is None:
                reply = await self.client.post_json(
                    url, "/run", body, retry_requests=replay, prior_attempts=sent
                )
            else:
                reply = await self.tracer.post_run(
                    self.client, url, body, retry_requests=replay, prior_attempts=sent
                )
        except Exception as exc:
            if not is_expected_failure(exc):
                raise
            if ladder is None:
                return await self._failed(row, exc, server)
            kind = request_error(exc)
            if kind is None:
                ladder.errors.pop()  # no connection: nothing was sent
            else:
                ladder.errors[-1] = kind
            return SendFailed(exc)
        elapsed = time.perf_counter() - started
        if self.health is not None:
            self.health.answered(url)
        if type(reply) is not dict:
            return await self._failed(
                row,
                ServerResponseError(
                    f"POST {url}/run answered a JSON {type(reply).__name__}, not an object; an environment "
                    "server must reply with the result object",
                    url=url + "/run",
                    status=200,
                    body_excerpt=excerpt_of(json.dumps(reply).encode()),
                ),
                server,
            )
        if self.shape == "examples":
            self.tracker.record(elapsed)
            self.completed += 1
            return row, reply
        outcome = classify_reply(row, reply, environment_server=server)
        if isinstance(outcome, RolloutFailureRecord):
            # not a successful /run: its latency (often a quick refusal) stays out of the percentiles and
            # the drain margin, which estimate how long a rollout takes
            self.failed += 1
            return row, outcome
        self.tracker.record(elapsed)
        self.completed += 1
        if self.shape == "completed":
            return row, CompletedRollout(row, outcome, elapsed * 1000.0, server, impl)
        return row, build_record(row, outcome, environment_server=server, result_type=impl)

    def _drained(self, row: Row, result: dict[str, Any], server: str, impl: str | None) -> tuple[Row, Any]:
        if self.shape == "examples":
            return row, result
        if self.shape == "completed":
            return row, CompletedRollout(row, result, None, server, impl)
        return row, build_record(row, result, environment_server=server, result_type=impl)

    async def _failed(
        self, row: Row, exc: Exception, server: str, ladder: Ladder | None = None
    ) -> tuple[Row, Any]:
        self.failed += 1
        sends: dict[str, Any] = {}
        if ladder is not None:
            sends = {"requests": len(ladder.errors), "request_errors": tuple(ladder.errors)}
        if self.route or self.shape == "outcomes":
            record = RolloutFailureRecord.from_exception(exc, row, environment_server=server, **sends)
            return row, (record.failure_fields() if self.shape == "examples" else record)
        if not self.record_unrouted:
            raise exc
        record = RolloutFailureRecord.from_exception(
            exc, row, environment_server=server, run_error=True, **sends
        )
        evidence = record.failure_fields() if self.shape == "examples" else record.to_row()
        if self.record_failure is None:
            return row, (evidence if self.shape == "examples" else record)
        pending = self.record_failure(row, evidence)
        if pending is not None:
            await pending
        raise exc

    def stats(self, it: CompletionIterator[Any, Any]) -> DispatchStats:
        p50 = self.tracker.quantile(0.5)
        p99 = self.tracker.quantile(0.99)
        return DispatchStats(
            in_flight=it.in_flight,
            admitted=it.admitted,
            drained=self.drained,
            failed=self.failed,
            completed=self.completed,
            p50_latency_ms=None if p50 is None else p50 * 1000.0,
            p99_latency_ms=None if p99 is None else p99 * 1000.0,
        )


class DispatchIterator(CompletionIterator[R, T]):
    """A :class:`CompletionIterator` of a dispatch, with :meth:`stats`."""

    _dispatcher: _Dispatcher | None = None

    def stats(self) -> DispatchStats:
        """Counters and latency percentiles so far (all zero / None before the dispatch is prepared)."""
        if self._dispatcher is None:
            return DispatchStats(self.in_flight, self.admitted, 0, 0, 0, None, None)
        return self._dispatcher.stats(self)


def build_dispatcher(
    client: ServerClient,
    topology: Topology,
    *,
    shape: Shape,
    semaphore: asyncio.Semaphore | None = None,
    dispatch_budget_s: float | None = None,
    drain_margin_s: float | None = None,
    route_failures_to_sidecar: bool = False,
    record_unrouted_failures: bool = False,
    record_failure: FailureRecorder | None = None,
    retry_requests: bool = True,
    clock: Callable[[], float] = time.monotonic,
    tracer: Tracer | None = None,
    health: ServerHealth | None = None,
    max_infra_retries: int = DEFAULT_MAX_INFRA_RETRIES,
    before_send: BeforeSend | None = None,
) -> _Dispatcher:
    """The per-dispatch row runner (internal: used by :func:`dispatch` and the helper)."""
    for name, value in (("dispatch_budget_s", dispatch_budget_s), ("drain_margin_s", drain_margin_s)):
        if value is not None and (isinstance(value, bool) or not value >= 0):
            raise InputError(f"{name}={value!r} must be a number >= 0 seconds, or None for no limit")
    return _Dispatcher(
        client,
        topology,
        shape=shape,
        semaphore=semaphore,
        dispatch_budget_s=dispatch_budget_s,
        drain_margin_s=drain_margin_s,
        route_failures_to_sidecar=route_failures_to_sidecar,
        record_unrouted_failures=record_unrouted_failures,
        record_failure=record_failure,
        retry_requests=retry_requests,
        clock=clock,
        tracer=tracer,
        health=health,
        max_infra_retries=max_infra_retries,
        before_send=before_send,
    )


def dispatch(
    rows: Iterable[Row],
    client: ServerClient,
    topology: Topology,
    *,
    max_resident_tasks: int | None = None,
    semaphore: asyncio.Semaphore | None = None,
    dispatch_budget_s: float | None = None,
    drain_margin_s: float | None = None,
    route_failures_to_sidecar: bool = False,
    record_unrouted_failures: bool = False,
    record_failure: FailureRecorder | None = None,
    retry_requests: bool = True,
    interleave: bool = False,
    clock: Callable[[], float] = time.monotonic,
    tracer: Tracer | None = None,
    health: ServerHealth | None = None,
    max_infra_retries: int = DEFAULT_MAX_INFRA_RETRIES,
    before_send: BeforeSend | None = None,
) -> DispatchIterator[Row, tuple[Row, CompletedRollout | RolloutFailureRecord]]:
    """Dispatch already-validated rows for collection; outcomes in completion order.

    Each item resolves to ``(row, CompletedRollout)`` for a result (a drained row too: its result is the
    drained dict, latency None) or ``(row, RolloutFailureRecord)`` for a failure: a routed ``/run`` failure,
    an episode failure, or a result using reserved keys. Episode replies are flattened (``result`` plus
    ``_ng_task_id``). With routing off a failed ``/run`` raises in its consumer; with
    ``record_unrouted_failures`` it is first handed to ``record_failure(row, failure_row)`` (``run_error``
    holds the error text), or, without a recorder, resolves to the record (``run_error`` set).

    Supports ``for item in it: await item`` and ``async for row, outcome in it``; close with ``aclose()``
    or ``aclose_and_drain()``. Rows are sent as they are (the caller validated them; see
    :func:`gym_ray.plan.preprocess.validate_rows`). With a ``tracer`` (:mod:`gym_ray.observe.tracing`) each
    row's
    dispatch is a root span of its own trace, linked to the job span current at this call, and ``/run``
    carries W3C ``traceparent``; None (the default) adds nothing to the hot path. With ``health``, an
    infrastructure failure is resent (up to ``max_infra_retries`` times) once the server is admitted again,
    and a server down past its outage timeout raises :class:`~gym_ray.errors.ServerOutageError` in the
    consumers of its rows (nothing is recorded for them). ``before_send(row)`` runs just before each
    ``/run`` leaves (after the drain check; again for an infrastructure resend); what it raises is the
    row's outcome, and the row is not sent.

    Raises:
        UsageError: ``max_resident_tasks`` < 1, or a negative budget / margin.
    """
    runner = build_dispatcher(
        client,
        topology,
        shape="completed",
        semaphore=semaphore,
        dispatch_budget_s=dispatch_budget_s,
        drain_margin_s=drain_margin_s,
        route_failures_to_sidecar=route_failures_to_sidecar,
        record_unrouted_failures=record_unrouted_failures,
        record_failure=record_failure,
        retry_requests=retry_requests,
        clock=clock,
        tracer=tracer,
        health=health,
        max_infra_retries=max_infra_retries,
        before_send=before_send,
    )
    source: Iterable[Row] = interleave_by_agent(rows) if interleave else rows
    it: DispatchIterator[Row, tuple[Row, CompletedRollout | RolloutFailureRecord]] = DispatchIterator(
        source, runner.run, max_resident_tasks=max_resident_tasks
    )
    it._dispatcher = runner
    return it

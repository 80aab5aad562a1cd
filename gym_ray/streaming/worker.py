"""The stream worker actor: runs the rows a :class:`~gym_ray.streaming.stream.RolloutStream` sends it.

One :class:`StreamWorker` is one async Ray actor with one HTTP client pool. The stream (the driver side)
``submit``\\ s batches of ``(seq, row)`` into the worker's bounded inbox and long-polls ``pull`` for finished
outcomes. Inside, an admission loop turns each inbox row into one task that POSTs its ``/run`` (routing and
failure classification as in :mod:`gym_ray.dispatch.engine`, failures routed to records), and every
finished outcome goes to the outbox with the policy version the row was admitted under.

Backpressure promise (exact): a row takes one of the worker's ``max_in_flight`` credits when it is
admitted and gives it back only when its outcome has been *pulled* (or the row was aborted or cancelled).
So rows sent to servers and not yet pulled never exceed ``max_in_flight``: when the consumer stops pulling,
the worker stops admitting.

Versions and pausing: the worker stamps every row it admits with its current policy version (set at
construction, by ``set_policy_version`` and by ``resume``). ``pause`` stops admission before it returns:
``drain`` then waits until every admitted row has finished; ``abort`` cancels them (the servers see their
handlers cancelled) and puts their rows back at the head of the inbox, so they run again first after
``resume``. ``cancel(seqs)`` removes rows for good wherever they are (inbox, running, outbox).

Concurrency promises: the admission loop and every row task are owned by ``run()``'s TaskGroup;
``close()`` stops admission, cancels every row task (its in-flight ``/run`` request is cancelled, so the
server sees its handler cancelled), waits until ``run()`` has ended and the client pool is closed, and
returns the unpulled outcomes when asked to drain. Outcomes are handed out once (popped by ``pull`` or
``close``). The worker records nothing: the stream records what it delivers. Only picklable data crosses
the actor boundary: rows, result dicts and :class:`~gym_ray.dispatch.outcomes.RolloutFailureRecord`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gym_ray import keys
from gym_ray.dispatch.health import ServerHealth
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord, build_record
from gym_ray.errors import GymRayError, InternalError

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

logger = logging.getLogger(__name__)

#: Actor ``max_concurrency``: run, submit, pull, close, pause, stats and pid calls at once (rows are not
#: calls).
STREAM_WORKER_MAX_CONCURRENCY = 16

#: What a stream's outage error ends with.
STREAM_STOP_HINT = (
    "the stream stopped: bring the server back, then open a new stream (with record_dir and resume=True it "
    "skips the rows already delivered)"
)

Outcome = dict[str, Any] | RolloutFailureRecord
SeqRow = tuple[int, dict[str, Any]]
#: ``(seq, outcome, policy version the row was admitted under)``.
Finished = tuple[int, Outcome, int]


@dataclass(frozen=True)
class StreamWorkerStats:
    """A snapshot of one stream worker.

    Attributes:
        worker: The worker's id.
        pid: Its process id.
        admitted: Rows sent to their environment server.
        finished: Rows with an outcome.
        in_flight: Rows admitted and not finished.
        outbox: Finished outcomes not yet pulled.
        inbox: Rows submitted and not yet admitted.
        credits: Free admission credits (``max_in_flight - in_flight - outbox``).
        paused: Admission is paused.
        policy_version: The version stamped on rows admitted now.
        aborted: Rows whose ``/run`` was cancelled by ``pause(abort=True)``.
        cancelled: Rows removed by ``cancel``.
    """

    worker: str
    pid: int
    admitted: int
    finished: int
    in_flight: int
    outbox: int
    inbox: int
    credits: int
    paused: bool = False
    policy_version: int = 0
    aborted: int = 0
    cancelled: int = 0


def outcome_of(row: Mapping[str, Any], outcome: CompletedRollout | RolloutFailureRecord) -> Outcome:
    """What a stream hands out for one dispatch outcome: the failure record, or the recorded result.

    A result is the record recording writes (the ``/run`` result plus the row's identity keys,
    ``_ng_environment_server`` and ``_ng_result_type``); when the server sent no ``ng_perf``, the
    collector adds ``ng_perf = {"total_latency_ms": <wall time of the /run>}``.
    """
    if isinstance(outcome, RolloutFailureRecord):
        return outcome
    record = build_record(
        row,
        outcome.result,
        environment_server=outcome.environment_server,
        result_type=outcome.environment_server_type,
    )
    if keys.NG_PERF not in record and outcome.rollout_latency_ms is not None:
        record[keys.NG_PERF] = {"total_latency_ms": outcome.rollout_latency_ms}
    return record


class StreamWorker:
    """Runs streamed rows with at most ``max_in_flight`` admitted-and-unpulled rows (see module docstring).

    Start it as a Ray async actor with ``num_cpus=0`` and ``max_concurrency=STREAM_WORKER_MAX_CONCURRENCY``,
    call ``run()`` once (it returns after ``close()``), then feed it with ``submit`` and drain it with
    ``pull``.

    Args:
        worker_id: The worker's name.
        topology: The running config, parsed (shipped as the object; never parsed again here).
        max_in_flight: Admission credits of this worker (>= 1).
        inbox_size: Rows ``submit`` may park before it waits for admission (>= 1).
        request_timeout_s: Timeout of each ``/run`` request (None: no limit).
        connect_timeout_s: Connect timeout of the client pool.
        retry_requests: Replay a request after a connection failure (see :class:`ServerClient`).
        policy_version: The version stamped on admitted rows until told otherwise.
        paused: Start with admission paused (until ``resume``).
        server_outage_timeout_s: How long a server may look down (its rows waiting) before its waiting
            rows raise :class:`~gym_ray.errors.ServerOutageError` (the run setting of the same name).
        max_infra_retries: Resends of one row after infrastructure failures while its server looked up.
    """

    def __init__(
        self,
        worker_id: str,
        topology: Topology,
        *,
        max_in_flight: int,
        inbox_size: int,
        request_timeout_s: float | None,
        connect_timeout_s: float,
        retry_requests: bool,
        policy_version: int = 0,
        paused: bool = False,
        server_outage_timeout_s: float = 300.0,
        max_infra_retries: int = 10,
    ) -> None:
        if max_in_flight < 1 or inbox_size < 1:
            raise InternalError(f"max_in_flight={max_in_flight} and inbox_size={inbox_size} must be >= 1")
        self._worker_id = worker_id
        self._topology = topology
        self._max_in_flight = max_in_flight
        self._inbox_size = inbox_size
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._retry_requests = retry_requests
        self._version = policy_version
        self._paused = paused
        self._outage_timeout_s = server_outage_timeout_s
        self._max_infra_retries = max_infra_retries
        self._inbox: deque[SeqRow] = deque()
        self._outbox: deque[Finished] = deque()
        self._credits = max_in_flight
        self._admitted = self._finished = self._aborted = self._cancelled = 0
        self._changed = asyncio.Event()  # inbox, outbox, credits, running rows, pause or stop changed
        self._stop = asyncio.Event()
        self._ended = asyncio.Event()
        self._started = False
        self._error: GymRayError | None = None
        self._running: dict[int, tuple[asyncio.Task[None], dict[str, Any]]] = {}
        self._ladders: dict[int, Any] = {}  # seq -> the retry ladder of a row not yet finished
        # Cancelled before their submit arrived (or already pulled): a few ints per cancelled row at most.
        self._cancelled_seqs: set[int] = set()

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    def stats(self) -> StreamWorkerStats:
        """A snapshot of the counters."""
        return StreamWorkerStats(
            worker=self._worker_id,
            pid=os.getpid(),
            admitted=self._admitted,
            finished=self._finished,
            in_flight=len(self._running),
            outbox=len(self._outbox),
            inbox=len(self._inbox),
            credits=self._credits,
            paused=self._paused,
            policy_version=self._version,
            aborted=self._aborted,
            cancelled=self._cancelled,
        )

    def _notify(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def submit(self, items: list[SeqRow]) -> None:
        """Park rows in the inbox, waiting while it holds ``inbox_size`` rows. Returns early after close."""
        for item in items:
            while len(self._inbox) >= self._inbox_size and not self._stop.is_set():
                await self._wait_change()
            if self._stop.is_set():
                return
            if item[0] in self._cancelled_seqs:
                self._cancelled_seqs.discard(item[0])
                continue
            self._inbox.append(item)
            self._notify()

    async def _wait_outbox(self, wait_s: float) -> None:
        if not self._outbox and not self._stop.is_set() and self._error is None:
            try:
                async with asyncio.timeout(wait_s):
                    while not self._outbox and not self._stop.is_set() and self._error is None:
                        await self._wait_change()
            except TimeoutError:
                pass
        if self._error is not None and not self._outbox:
            raise self._error

    async def pull(self, max_items: int, wait_s: float) -> list[Finished]:
        """Up to ``max_items`` finished outcomes, waiting up to ``wait_s`` for the first one.

        Pulled outcomes give their admission credits back. After ``close()`` the outbox is still handed out.

        Raises:
            GymRayError: ``run()`` failed: the worker admits nothing more.
        """
        await self._wait_outbox(wait_s)
        count = min(max(0, max_items), len(self._outbox))
        items = [self._outbox.popleft() for _ in range(count)]
        self._credits += count
        if count:
            self._notify()
        return items

    async def ready(self, wait_s: float) -> int:
        """Finished outcomes waiting in the outbox, after waiting up to ``wait_s`` for a first one.

        Raises:
            GymRayError: ``run()`` failed and nothing is left to pull.
        """
        await self._wait_outbox(wait_s)
        return len(self._outbox)

    def set_policy_version(self, version: int) -> None:
        """Stamp ``version`` on every row admitted from now on."""
        self._version = version

    async def pause(self, abort: bool, drain_timeout_s: float | None = None) -> int:
        """Stop admission; then wait for the running rows to finish, or cancel them (``abort``).

        ``drain_timeout_s`` (drain only): cancel the rows still running after this many seconds, as an
        abort does. Aborted rows go back to the head of the inbox in seq order and give their credits back;
        their outcomes are never produced. Returns the number of rows aborted.
        """
        self._paused = True
        self._notify()
        if not abort:
            deadline = asyncio.timeout(drain_timeout_s)
            try:
                async with deadline:
                    while self._running and not self._stop.is_set() and not self._ended.is_set():
                        await self._wait_change()
                return 0
            except TimeoutError:
                if not deadline.expired():
                    raise
        aborted = sorted((seq, row) for seq, (_, row) in self._running.items())
        await self._cancel_running([seq for seq, _ in aborted])
        self._inbox.extendleft(reversed(aborted))
        self._aborted += len(aborted)
        self._notify()
        return len(aborted)

    def resume(self, version: int) -> None:
        """Restart admission, stamping ``version`` on the rows admitted from now on."""
        self._version = version
        self._paused = False
        self._notify()

    async def cancel(self, seqs: Iterable[int]) -> int:
        """Remove these rows for good, wherever they are; returns how many were found.

        Rows in the inbox are dropped, running rows have their ``/run`` cancelled (this waits until their
        tasks have ended, so the servers see the handlers cancelled), finished ones leave the outbox
        unpulled, and a row whose ``submit`` has not arrived yet is dropped when it does.
        """
        wanted = set(seqs)
        found: set[int] = set()
        kept: deque[SeqRow] = deque()
        for item in self._inbox:
            if item[0] in wanted:
                found.add(item[0])
            else:
                kept.append(item)
        self._inbox = kept
        running = [seq for seq in self._running if seq in wanted]
        found.update(running)
        await self._cancel_running(running)
        for seq in wanted:
            self._ladders.pop(seq, None)
        outbox: deque[Finished] = deque()
        for finished in self._outbox:
            if finished[0] in wanted:
                found.add(finished[0])
            else:
                outbox.append(finished)
        self._credits += len(self._outbox) - len(outbox)
        self._outbox = outbox
        self._cancelled_seqs |= wanted - found
        self._cancelled += len(found)
        self._notify()
        return len(found)

    async def _cancel_running(self, seqs: list[int]) -> None:
        tasks = []
        for seq in seqs:
            task, _ = self._running.pop(seq)
            task.cancel()
            tasks.append(task)
        self._credits += len(tasks)
        if tasks:
            await asyncio.wait(tasks)

    async def close(self, drain: bool) -> list[Finished]:
        """Stop admission, cancel in-flight rows, wait for ``run()``, flush and shut down this process's
        telemetry (:func:`~gym_ray.observe.tracing.shutdown_tracing`); return unpulled outcomes if ``drain``.

        Idempotent; a second drain returns what is left (nothing, once handed out).
        """
        from gym_ray.observe.tracing_gate import shutdown_tracing_if_used

        self._stop.set()
        self._notify()
        for task, _ in list(self._running.values()):
            task.cancel()
        if self._started:
            await self._ended.wait()
        await asyncio.to_thread(shutdown_tracing_if_used)
        if not drain:
            return []
        items = list(self._outbox)
        self._outbox.clear()
        return items

    async def run(self) -> int:
        """Admit rows until ``close()``; returns the number of rows finished.

        Raises:
            GymRayError: A row's dispatch failed unexpectedly (the error is also raised by later ``pull``
                calls).
        """
        from gym_ray.dispatch.client import ServerClient
        from gym_ray.dispatch.engine import build_dispatcher

        if self._started:
            raise InternalError(f"stream worker {self._worker_id}: run() called twice")
        self._started = True
        try:
            topology = self._topology
            logger.info(
                "stream worker %s (pid %d): max_in_flight=%d inbox_size=%d, TCPConnector limit=%d, "
                "request_timeout_s=%s connect_timeout_s=%s, actor max_concurrency=%d",
                self._worker_id,
                os.getpid(),
                self._max_in_flight,
                self._inbox_size,
                self._max_in_flight,
                self._request_timeout_s,
                self._connect_timeout_s,
                STREAM_WORKER_MAX_CONCURRENCY,
            )
            async with (
                ServerClient(
                    topology,
                    max_connections=self._max_in_flight,
                    connect_timeout_s=self._connect_timeout_s,
                    request_timeout_s=self._request_timeout_s,
                    retry_requests=self._retry_requests,
                ) as client,
                ServerHealth(
                    client, outage_timeout_s=self._outage_timeout_s, stop_hint=STREAM_STOP_HINT
                ) as health,
            ):
                # infrastructure failures are resent and a down server's rows wait (see ServerHealth)
                runner = build_dispatcher(
                    client,
                    topology,
                    shape="completed",
                    route_failures_to_sidecar=True,
                    retry_requests=self._retry_requests,
                    health=health,
                    max_infra_retries=self._max_infra_retries,
                )
                async with asyncio.TaskGroup() as group:
                    admit = group.create_task(self._admit(group, runner))
                    await self._stop.wait()
                    admit.cancel()
                    for task, _ in list(self._running.values()):
                        task.cancel()
        except ExceptionGroup as group_error:
            first = group_error.exceptions[0]
            self._error = (
                first if isinstance(first, GymRayError) else InternalError(f"{type(first).__name__}: {first}")
            )
            raise self._error from group_error
        except GymRayError as exc:
            self._error = exc
            raise
        finally:
            self._ended.set()
            self._notify()
        return self._finished

    async def _admit(self, group: asyncio.TaskGroup, runner: Any) -> None:
        while True:
            while self._paused or self._credits < 1 or not self._inbox:
                await self._wait_change()
            seq, row = self._inbox.popleft()
            self._credits -= 1
            self._admitted += 1
            self._notify()  # inbox space for submit
            task = group.create_task(self._run_row(seq, row, runner, self._version))
            self._running[seq] = (task, row)

    async def _run_row(self, seq: int, row: dict[str, Any], runner: Any, version: int) -> None:
        # a row aborted by pause("abort") and run again keeps its ladder: its retry budgets survive pauses
        ladder = self._ladders.get(seq)
        if ladder is None:
            ladder = self._ladders[seq] = runner.new_ladder()
        row, outcome = await runner.run(row, ladder)
        self._ladders.pop(seq, None)
        entry = self._running.get(seq)
        if entry is None or entry[0] is not asyncio.current_task():
            return  # aborted or cancelled after the reply arrived: the outcome is not handed out
        del self._running[seq]
        self._finished += 1
        self._outbox.append((seq, outcome_of(row, outcome), version))
        self._notify()

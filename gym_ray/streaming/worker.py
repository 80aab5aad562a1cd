"""The stream worker actor: runs the rows a :class:`~gym_ray.streaming.stream.RolloutStream` sends it.

One :class:`StreamWorker` is one async Ray actor with one HTTP client pool. The stream (the driver side)
``submit``\\ s batches of ``(seq, row)`` into the worker's bounded inbox and long-polls ``pull`` for finished
outcomes. Inside, an admission loop turns inbox rows into dispatch segments (each a bounded
:func:`gym_ray.dispatch.engine.dispatch` over the rows available at that moment, failures routed to
records), and
every finished outcome goes to the outbox.

Backpressure promise (exact): a row takes one of the worker's ``max_in_flight`` credits when it is
admitted and gives it back only when its outcome has been *pulled*. So rows sent to servers and not yet
pulled never exceed ``max_in_flight``: when the consumer stops pulling, the worker stops admitting.

Concurrency promises: the admission loop and every segment are tasks owned by ``run()``'s TaskGroup;
``close()`` stops admission, cancels every segment (its in-flight ``/run`` requests are cancelled, so the
servers see their handlers cancelled), waits until ``run()`` has ended and the client pool is closed, and
returns the unpulled outcomes when asked to drain. Outcomes are handed out once (popped by ``pull`` or
``close``). With a ``record_dir`` every outcome is appended through a
:class:`~gym_ray.record.writer.ShardWriter`
(one shard per worker incarnation) before it enters the outbox, so a recorded outcome survives a crash of
either side. Only picklable data crosses the actor boundary: rows, result dicts and
:class:`~gym_ray.dispatch.outcomes.RolloutFailureRecord`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gym_ray import keys
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord, build_record
from gym_ray.errors import GymRayError, InternalError

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

logger = logging.getLogger(__name__)

#: Actor ``max_concurrency``: run, submit, pull, close, stats and pid calls at once (rows are not calls).
STREAM_WORKER_MAX_CONCURRENCY = 16

Outcome = dict[str, Any] | RolloutFailureRecord
SeqRow = tuple[int, dict[str, Any]]


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
    """

    worker: str
    pid: int
    admitted: int
    finished: int
    in_flight: int
    outbox: int
    inbox: int
    credits: int


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
        worker_id: The worker's name (also its shard label suffix when recording).
        topology: The running config, parsed (shipped as the object; never parsed again here).
        max_in_flight: Admission credits of this worker (>= 1).
        inbox_size: Rows ``submit`` may park before it waits for admission (>= 1).
        request_timeout_s: Timeout of each ``/run`` request (None: no limit).
        connect_timeout_s: Connect timeout of the client pool.
        retry_requests: Replay a request after a connection failure (see :class:`ServerClient`).
        record_dir: Run folder to record every outcome in, or None.
        run_id: The stream's run id (recorded in the shard's lock token and progress).
        shard: The shard label this worker records under.
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
        record_dir: str | None,
        run_id: str,
        shard: str,
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
        self._record_dir = record_dir
        self._run_id = run_id
        self._shard = shard
        self._inbox: deque[SeqRow] = deque()
        self._outbox: deque[tuple[int, Outcome]] = deque()
        self._credits = max_in_flight
        self._admitted = self._finished = 0
        self._changed = asyncio.Event()  # inbox, outbox, credits or stop changed
        self._stop = asyncio.Event()
        self._ended = asyncio.Event()
        self._started = False
        self._error: GymRayError | None = None
        self._segments: set[asyncio.Task[None]] = set()

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    def stats(self) -> StreamWorkerStats:
        """A snapshot of the counters."""
        in_flight = self._max_in_flight - self._credits - len(self._outbox)
        return StreamWorkerStats(
            worker=self._worker_id,
            pid=os.getpid(),
            admitted=self._admitted,
            finished=self._finished,
            in_flight=in_flight,
            outbox=len(self._outbox),
            inbox=len(self._inbox),
            credits=self._credits,
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
            self._inbox.append(item)
            self._notify()

    async def pull(self, max_items: int, wait_s: float) -> list[tuple[int, Outcome]]:
        """Up to ``max_items`` finished outcomes, waiting up to ``wait_s`` for the first one.

        Pulled outcomes give their admission credits back. After ``close()`` the outbox is still handed out.

        Raises:
            GymRayError: ``run()`` failed (a shard write failed, say): the worker admits nothing more.
        """
        if not self._outbox and not self._stop.is_set() and self._error is None:
            try:
                async with asyncio.timeout(wait_s):
                    while not self._outbox and not self._stop.is_set() and self._error is None:
                        await self._wait_change()
            except TimeoutError:
                pass
        if self._error is not None and not self._outbox:
            raise self._error
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
        if not self._outbox and not self._stop.is_set() and self._error is None:
            try:
                async with asyncio.timeout(wait_s):
                    while not self._outbox and not self._stop.is_set() and self._error is None:
                        await self._wait_change()
            except TimeoutError:
                pass
        if self._error is not None and not self._outbox:
            raise self._error
        return len(self._outbox)

    async def close(self, drain: bool) -> list[tuple[int, Outcome]]:
        """Stop admission, cancel in-flight rows, wait for ``run()``, flush and shut down this process's
        telemetry (:func:`~gym_ray.observe.tracing.shutdown_tracing`); return unpulled outcomes if ``drain``.

        Idempotent; a second drain returns what is left (nothing, once handed out).
        """
        from gym_ray.observe.tracing import shutdown_tracing

        self._stop.set()
        self._notify()
        for segment in list(self._segments):
            segment.cancel()
        if self._started:
            await self._ended.wait()
        await asyncio.to_thread(shutdown_tracing)
        if not drain:
            return []
        items = list(self._outbox)
        self._outbox.clear()
        return items

    async def run(self) -> int:
        """Admit rows until ``close()``; returns the number of rows finished.

        Raises:
            GymRayError: Recording failed (the error is also raised by later ``pull`` calls).
        """
        from gym_ray.dispatch.client import ServerClient
        from gym_ray.record.writer import ShardWriter

        if self._started:
            raise InternalError(f"stream worker {self._worker_id}: run() called twice")
        self._started = True
        try:
            topology = self._topology
            logger.info(
                "stream worker %s (pid %d): max_in_flight=%d inbox_size=%d, TCPConnector limit=%d, "
                "request_timeout_s=%s connect_timeout_s=%s, actor max_concurrency=%d, record_dir=%s",
                self._worker_id,
                os.getpid(),
                self._max_in_flight,
                self._inbox_size,
                self._max_in_flight,
                self._request_timeout_s,
                self._connect_timeout_s,
                STREAM_WORKER_MAX_CONCURRENCY,
                self._record_dir,
            )
            writer: ShardWriter | None = None
            if self._record_dir is not None:
                writer = ShardWriter(
                    self._record_dir,
                    self._shard,
                    run_id=self._run_id,
                    config_identity=topology.identity_digest(),
                ).open()
            try:
                async with ServerClient(
                    topology,
                    max_connections=self._max_in_flight,
                    connect_timeout_s=self._connect_timeout_s,
                    request_timeout_s=self._request_timeout_s,
                    retry_requests=self._retry_requests,
                ) as client:
                    async with asyncio.TaskGroup() as group:
                        admit = group.create_task(self._admit(group, client, topology, writer))
                        await self._stop.wait()
                        admit.cancel()
                        for segment in list(self._segments):
                            segment.cancel()
                if writer is not None:
                    writer.write_progress()
            finally:
                if writer is not None:
                    writer.close()
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

    async def _admit(self, group: asyncio.TaskGroup, client: Any, topology: Any, writer: Any) -> None:
        while True:
            while self._credits < 1 or not self._inbox:
                await self._wait_change()
            batch: list[SeqRow] = []
            while self._inbox and len(batch) < self._credits:
                batch.append(self._inbox.popleft())
            self._credits -= len(batch)
            self._admitted += len(batch)
            self._notify()  # inbox space for submit
            segment = group.create_task(self._segment(batch, client, topology, writer))
            self._segments.add(segment)
            segment.add_done_callback(self._segments.discard)

    async def _segment(self, batch: list[SeqRow], client: Any, topology: Any, writer: Any) -> None:
        from gym_ray.dispatch.engine import dispatch

        seq_of = {id(row): seq for seq, row in batch}
        completions = dispatch(
            [row for _, row in batch],
            client,
            topology,
            max_resident_tasks=len(batch),
            route_failures_to_sidecar=True,
            retry_requests=self._retry_requests,
        )
        try:
            async for row, outcome in completions:
                item = outcome_of(row, outcome)
                if writer is not None:
                    writer.append(item.to_row() if isinstance(item, RolloutFailureRecord) else item)
                self._finished += 1
                self._outbox.append((seq_of[id(row)], item))
                self._notify()
        finally:
            await completions.aclose()

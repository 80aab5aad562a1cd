"""``RolloutCollectionHelper``: the NeMo Gym-style entry point for driving dispatch from your own code.

The helper owns one :class:`~gym_ray.dispatch.client.ServerClient` (explicit connection limits and
timeouts) and
knows the running config: given as a dict / :class:`~gym_ray.config.topology.Topology`, or fetched from a head
server (again on every call, unless ``cache_head_config=True``). ``aclose()`` closes what it owns.

Concurrency promises are those of :mod:`gym_ray.dispatch.engine`: one task per row, lazy bounded admission,
every task joined by the iterator's ``aclose()`` / ``aclose_and_drain()``.

Recording (``record_output_dir`` + ``record_shard``) writes each outcome from its row's own task through
the shard's locked writer (:mod:`gym_ray.record.recording`); the rows are then held as a list (the
shard's materialized inputs are written whole before the first row runs), so memory grows with the rows
of that call.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import (
    DispatchIterator,
    FailureRecorder,
    Shape,
    build_dispatcher,
    interleave_by_agent,
)
from gym_ray.dispatch.enrich import OBSERVABILITY_ENABLED, check_capture_options, enrich_run_result, needs_io
from gym_ray.dispatch.head import HeadAddress, HeadClientCache, fetch_global_config, head_url_of
from gym_ray.dispatch.outcomes import RolloutFailureRecord, build_record
from gym_ray.errors import UsageError
from gym_ray.record.recording import ShardRecorder

Row = dict[str, Any]


HeadConfig = str | Mapping[str, Any] | Topology | HeadAddress


R = TypeVar("R")
T = TypeVar("T")
#: Rows validated per batch when the input is a one-shot iterator (a list is validated whole).
VALIDATION_BATCH = 1024


class _LiveTopology:
    """Lets the helper's client resolve instance names against whatever config the helper holds now."""

    def __init__(self, helper: RolloutCollectionHelper) -> None:
        self._helper = helper

    @property
    def instances(self) -> Mapping[str, Any]:
        return self._helper._require_topology().instances

    def url_of(self, instance: str) -> str:
        return self._helper._require_topology().url_of(instance)


class _RecordingIterator(DispatchIterator[R, T]):
    """A dispatch whose outcomes are recorded: closing it also finishes the shard (progress, close)."""

    _recorder: ShardRecorder | None = None

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._recorder is not None:
                self._recorder.closing()

    async def aclose_and_drain(self) -> list[asyncio.Future[T]]:
        try:
            return await super().aclose_and_drain()
        finally:
            if self._recorder is not None:
                self._recorder.closing()


def _head_url_of(config: Mapping[str, Any]) -> str | None:
    head = config.get(keys.HEAD_SERVER)
    if isinstance(head, Mapping) and head.get("host") is not None and head.get("port") is not None:
        return f"http://{head['host']}:{head['port']}"
    return None


class RolloutCollectionHelper:
    """Dispatch rows to a running deployment and get outcomes back in completion order.

    Example:
        >>> helper = RolloutCollectionHelper("http://127.0.0.1:11000")
        >>> completions = helper.run_examples(rows, max_resident_tasks=64)
        >>> try:
        ...     for future in completions:
        ...         row, result = await future
        ... finally:
        ...     await completions.aclose()
        ...     await helper.aclose()

    Args:
        head_server_config: A head server (a URL ``"http://host:port"``, a ``{host, port}`` mapping, or an
            object with ``host`` and ``port`` attributes such as NeMo Gym's ``BaseServerConfig``), a global
            config dict, a :class:`Topology`, or None (then pass ``head_server_config`` to each call).
        cache_head_config: With a head URL, keep one client and refetch the config per call only to compare
            it (a changed config builds a new client); without it every call fetches the config again.
        max_connections: Requests on the wire at once (the aiohttp connector ``limit``).
        connect_timeout_s: Limit for establishing one connection.
        request_timeout_s: Limit for one request attempt; None means no limit.
        connect_retries: Retries of a connection that could not be established (nothing was sent).
        retry_requests: Default for replaying a request whose body may have been received.
        clock: Monotonic clock for dispatch budgets (injectable for tests).
    """

    def __init__(
        self,
        head_server_config: HeadConfig | None = None,
        *,
        cache_head_config: bool = False,
        max_connections: int = 256,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 900.0,
        connect_retries: int = 3,
        retry_requests: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client_kwargs: dict[str, Any] = {
            "max_connections": max_connections,
            "connect_timeout_s": connect_timeout_s,
            "request_timeout_s": request_timeout_s,
            "connect_retries": connect_retries,
            "retry_requests": retry_requests,
        }
        self._head_url: str | None = None
        self._topology: Topology | None = None
        if head_server_config is not None:
            self._head_url = head_url_of(head_server_config)
            if isinstance(head_server_config, Topology):
                self._topology = head_server_config
            elif self._head_url is None and isinstance(head_server_config, Mapping):
                self._topology = Topology.from_config(head_server_config)
        self._cache = cache_head_config
        self._head_cache = HeadClientCache(client_factory=self._client_for) if cache_head_config else None
        self._client = ServerClient(_LiveTopology(self), **self._client_kwargs)
        self._clock = clock

    # --- config and client ---------------------------------------------------------------------------
    @property
    def topology(self) -> Topology | None:
        """The running config as last given or fetched (None before the first fetch)."""
        return self._topology

    def _require_topology(self) -> Topology:
        if self._topology is None:
            raise UsageError(
                "this RolloutCollectionHelper has no config yet: await setup_server_client() first, or build "
                "it with a global config dict / Topology"
            )
        return self._topology

    def _client_for(self, config: dict[str, Any]) -> ServerClient:
        return ServerClient(Topology.from_config(config), **self._client_kwargs)

    async def setup_server_client(self, head_server_config: HeadConfig | None = None) -> ServerClient:
        """Return a client for the head's servers, fetching the head's config first.

        Without ``cache_head_config`` every call fetches the config again and the helper's own client is
        returned. With it, the cached client is reused while the fetched config equals the cached one (a
        changed config builds a new client and closes the old: build a new helper after the configuration
        behind the same head changes). A helper built from a config dict / Topology fetches nothing.
        The helper owns every client it returns; :meth:`aclose` closes them.

        Raises:
            ServerConnectionError, ServerHTTPError, ServerResponseError: the head could not be read.
            ConfigError: the fetched config is not a valid topology.
        """
        head_url = self._head_url
        named = head_url_of(head_server_config) if head_server_config is not None else None
        if named is not None:
            head_url = named
        elif head_server_config is not None:
            assert isinstance(head_server_config, Topology | Mapping)  # head_url_of refused the rest
            self._topology = (
                head_server_config
                if isinstance(head_server_config, Topology)
                else Topology.from_config(head_server_config)
            )
            return self._client
        if head_url is None:
            self._require_topology()
            return self._client
        if self._head_cache is not None:
            config, client = await self._head_cache.get(head_url)
            self._topology = Topology.from_config(config)
            return client
        self._topology = Topology.from_config(await fetch_global_config(head_url))
        return self._client

    def load_sample(self) -> Any:
        """One sample of requests waiting and running, summed over every server (the helper's client)."""
        return self._client.load_sample()

    async def aclose(self) -> None:
        """Close the helper's client and any cached one. Idempotent."""
        try:
            await self._client.aclose()
        finally:
            if self._head_cache is not None:
                await self._head_cache.aclose()

    async def __aenter__(self) -> RolloutCollectionHelper:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- preprocessing / aggregation (delegations) ---------------------------------------------------
    def preprocess_examples(
        self,
        examples: Iterable[Mapping[str, Any]],
        *,
        global_config_dict: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> list[Row]:
        """Apply agent_map / fan_out / num_repeats etc. (:func:`gym_ray.plan.preprocess.preprocess_examples`).

        The helper's config (if known) resolves task_source-only rows unless ``global_config_dict`` is given.
        """
        from gym_ray.plan.preprocess import preprocess_examples

        if global_config_dict is None and self._topology is not None and "topology" not in kw:
            kw["topology"] = self._topology
        return preprocess_examples(examples, global_config_dict=global_config_dict, **kw)

    def resolve_task_sources(
        self, rows: Iterable[Mapping[str, Any]], global_config_dict: Mapping[str, Any] | None = None
    ) -> list[Row]:
        """Stamp ``agent_ref`` on task_source-only rows
        (:func:`gym_ray.plan.preprocess.resolve_task_sources`)."""
        from gym_ray.plan.preprocess import resolve_task_sources

        topology = (
            Topology.from_config(global_config_dict) if global_config_dict else self._require_topology()
        )
        return resolve_task_sources(rows, topology)

    async def aggregate_metrics(
        self, results: Iterable[Mapping[str, Any]], *, output_path: str | Path, raise_on_error: bool = True
    ) -> Path | None:
        """``/aggregate_metrics`` once per environment server (``gym_ray.finalize.aggregate``)."""
        from gym_ray.finalize.aggregate import aggregate_metrics

        client = await self.setup_server_client()
        return await aggregate_metrics(
            results, self._require_topology(), client, output_path=output_path, raise_on_error=raise_on_error
        )

    # --- dispatch ------------------------------------------------------------------------------------
    def _iterator(
        self,
        rows: Iterable[Row],
        *,
        shape: Shape,
        head_server_config: HeadConfig | None,
        semaphore: asyncio.Semaphore | None,
        route_failures_to_sidecar: bool,
        record_unrouted_failures: bool,
        record_failure: FailureRecorder | None,
        environment_server_name: str | None,
        max_resident_tasks: int | None,
        dispatch_budget_s: float | None,
        drain_margin_s: float | None,
        interleave: bool,
        retry_requests: bool,
        batch_size: int,
        enrich: tuple[bool, bool] | None = None,
        recorder: ShardRecorder | None = None,
    ) -> DispatchIterator[Row, Any]:
        if recorder is not None:
            copies = recorder.stamp(rows)
            batch_size = len(copies)  # one validation batch: the inputs file is written before any row runs
            rows = recorder.rows_to_run(copies)  # lazy: the shard is taken over when the first row is pulled
            if not route_failures_to_sidecar and (not record_unrouted_failures or record_failure is not None):
                record_failure = recorder.failure_recorder(record_failure)
                record_unrouted_failures = True
        runner = build_dispatcher(
            self._client,
            self._topology,  # type: ignore[arg-type]  # set by prepare() before any row runs
            shape="completed" if enrich is not None else shape,
            semaphore=semaphore,
            dispatch_budget_s=dispatch_budget_s,
            drain_margin_s=drain_margin_s,
            route_failures_to_sidecar=route_failures_to_sidecar,
            record_unrouted_failures=record_unrouted_failures,
            record_failure=record_failure,
            retry_requests=retry_requests,
            clock=self._clock,
        )
        needs_fetch = head_server_config is not None or self._topology is None

        async def prepare() -> None:
            runner.client = await self.setup_server_client(head_server_config)
            runner.topology = self._require_topology()

        def validate(batch: list[Row]) -> list[Row]:
            from gym_ray.plan.preprocess import (
                resolve_task_sources,
                stamp_environment_agent_refs,
                validate_rows,
            )

            topology = runner.topology
            if environment_server_name is not None:
                batch = [
                    r
                    if r.get(keys.ENVIRONMENT_SERVER) == environment_server_name
                    else {**r, keys.ENVIRONMENT_SERVER: environment_server_name}
                    for r in batch
                ]
            batch = resolve_task_sources(stamp_environment_agent_refs(batch, topology), topology)
            validate_rows(batch, topology)
            if recorder is not None:
                recorder.start(batch, config_identity=topology.identity_digest())
            return batch

        source: Iterable[Row] = interleave_by_agent(rows) if interleave else rows
        run: Callable[[Row], Coroutine[Any, Any, tuple[Row, Any]]] = runner.run
        if enrich is not None:
            run = _enriching(runner, include_payloads=enrich[0], delete_capture=enrich[1])
        if recorder is not None:
            run = recorder.wrap(run)
        it: _RecordingIterator[Row, Any] = _RecordingIterator(
            source,
            run,
            max_resident_tasks=max_resident_tasks,
            prepare=prepare if needs_fetch else None,
            validate_batch=validate,
            batch_size=batch_size,
        )
        it._dispatcher = runner
        it._recorder = recorder
        return it

    def run_examples(
        self,
        examples: Iterable[Row],
        head_server_config: HeadConfig | None = None,
        semaphore: asyncio.Semaphore | None = None,
        *,
        route_failures_to_sidecar: bool = False,
        record_unrouted_failures: bool = False,
        record_failure: FailureRecorder | None = None,
        environment_server_name: str | None = None,
        max_resident_tasks: int | None = None,
        dispatch_budget_s: float | None = None,
        drain_margin_s: float | None = None,
        interleave_by_agent: bool = False,
        retry_requests: bool = True,
        enrich_results: bool = False,
        include_model_call_payloads: bool = True,
        delete_model_call_capture: bool = False,
        record_output_dir: str | os.PathLike[str] | None = None,
        record_shard: str | None = None,
        record_omitted_rollouts: bool = False,
    ) -> DispatchIterator[Row, tuple[Row, Row]]:
        """POST each row to its environment server's ``/run``; awaitables of ``(row, result)`` as they finish.

        Rows are dispatched as given (call :meth:`preprocess_examples` first for agent_map / fan_out /
        num_repeats): task_sources are resolved and rows validated against the running config before the
        first request (a list is validated whole, so nothing is sent when it fails; a one-shot iterator in
        batches of 1024 rows, each before any of its rows is sent). Each row goes to its
        ``_ng_environment_server`` stamp (``environment_server_name`` overrides it on a copy), else the
        front of its agent; a flat row is sent verbatim, a materialized task row as the episode envelope.
        Rows start in the order given once the iterator is first consumed; ``interleave_by_agent``
        round-robins rows across agents (in windows of 4096 rows).

        A row that ran resolves to exactly what ``/run`` returned. A row the budget did not start resolves
        to the drained dict (``_ng_failure_class="cancelled"``, ``_ng_no_persist``, ``_ng_dispatch_drained``,
        ``error_message``). A failed ``/run`` (error status, no answer, bad JSON, a reply that is not an
        object) raises in the consumer that claims it, unless ``route_failures_to_sidecar`` makes it a
        failure row of ``_ng_failure_*`` fields. With routing off, ``record_unrouted_failures`` resolves the
        failure to that row with ``run_error`` holding the error text; if ``record_failure`` is given, it is
        called with ``(row, failure_row)`` instead and the original error is then raised.

        Args:
            examples: Rows (any iterable; a one-shot iterator is pulled lazily in bounded mode).
            head_server_config: Overrides the helper's head URL / config for this call.
            semaphore: Held by each row around its drain check and request.
            route_failures_to_sidecar: Failed ``/run`` calls become failure rows instead of errors.
            record_unrouted_failures: See above.
            record_failure: See above.
            environment_server_name: Send every row to this environment server.
            max_resident_tasks: At most this many rows are resident (running or finished and unclaimed);
                admission starts when the first awaitable is awaited. None schedules every row up front.
            dispatch_budget_s: Stop starting rows this many seconds after this call.
            drain_margin_s: Stop sooner for rows that would not finish (default: p75 of successful latencies
                once 5 exist).
            interleave_by_agent: Round-robin rows across agents.
            retry_requests: False never replays a ``/run`` that may have been received.
            enrich_results: Resolve each result to what collection records, enriched by
                :func:`gym_ray.dispatch.enrich.enrich_run_result` (identity, ``ng_model_call_capture`` when
                the
                config sets ``observability_enabled``, ``ng_trajectory``, ``ng_perf``); results are
                validated, and a routed ``/run`` failure resolves to the typed ``RolloutFailureRecord``.
                Off: results are exactly what ``/run`` returned.
            include_model_call_payloads: With ``enrich_results``, keep request/response bodies of
                captured model calls.
            delete_model_call_capture: With ``enrich_results``, remove each rollout's capture file after
                it is merged (needs ``include_model_call_payloads``).
            record_output_dir: With ``record_shard``, also record every rollout as shard ``record_shard``
                of this run folder, as collection records a shard: ``rollouts-<shard>.jsonl`` (the
                returned records), its failures sidecar (typed failure rows; an unrouted ``/run``
                failure is kept there before it is raised), the rows as its materialized inputs and its
                manifest (written before the first row runs), and its progress (written once the
                iterator is exhausted or closed). It implies ``enrich_results``. The rows are dispatched
                as copies naming the shard's run (``_ng_run_id``: a fresh id, or the id the shard was
                recorded with), each with the rollout id ``<run_id>-<own id>`` (own id: the row's
                ``_ng_rollout_id``, else ``<task>-<rollout>``),
                so they need integer ``_ng_task_index`` / ``_ng_rollout_index``. ``plan_resume`` and
                ``gym-ray status`` read the shard like a collection shard. The rows are held as a list
                (memory grows with them); record large inputs with ``gym-ray run``.
            record_shard: The shard label (``[A-Za-z0-9._-]``). A shard that already holds records is
                resumed when these are its rows (the same rows, stamped with the run id it was recorded
                with): only what is missing runs, with attempt indices, and only those rows are handed
                back. Other rows are refused (``ResumeError``) as other materialized inputs. The first
                row pulled opens the shard's writer: the last call to record a shard holds it, and an
                older writer still running gets ``ShardLockError`` on its next write.
            record_omitted_rollouts: When recording, keep drained rows in the failures sidecar.

        Returns:
            An iterator of awaitables (also ``async for``), with ``aclose()``, ``aclose_and_drain()`` and
            ``stats()``. Close it in ``finally`` (see ``CompletionIterator.aclose``).

        Raises:
            UsageError: ``max_resident_tasks`` < 1 or a negative budget (at call),
            ``delete_model_call_capture`` without the payloads (at call), only one of
            ``record_output_dir`` / ``record_shard``;
            ``ValidationError`` / ``RoutingError`` from validation at first consumption.
            ResumeError: When recording, a shard that holds records of other rows (at call, or at first
                consumption when the validated rows or the config differ).
            InputError: When recording, a row without integer rollout identities (at call).
            ConfigError: An invalid ``record_shard`` label (at call).
            ShardLockError, ShardIOError: From the shard writer, raised by the awaitable of the row
                whose record could not be written.
        """
        recorder = _recorder_for(record_output_dir, record_shard, None, record_omitted_rollouts)
        return self._iterator(
            examples,
            shape="examples",
            head_server_config=head_server_config,
            semaphore=semaphore,
            route_failures_to_sidecar=route_failures_to_sidecar,
            record_unrouted_failures=record_unrouted_failures,
            record_failure=record_failure,
            environment_server_name=environment_server_name,
            max_resident_tasks=max_resident_tasks,
            dispatch_budget_s=dispatch_budget_s,
            drain_margin_s=drain_margin_s,
            interleave=interleave_by_agent,
            retry_requests=retry_requests,
            batch_size=len(examples) if isinstance(examples, Sequence) else VALIDATION_BATCH,
            enrich=_enrich_options(
                enrich_results or recorder is not None, include_model_call_payloads, delete_model_call_capture
            ),
            recorder=recorder,
        )

    def run_outcomes(
        self,
        examples: Iterable[Mapping[str, Any]],
        head_server_config: HeadConfig | None = None,
        *,
        run_id: str | None = None,
        semaphore: asyncio.Semaphore | None = None,
        environment_server_name: str | None = None,
        max_resident_tasks: int | None = None,
        dispatch_budget_s: float | None = None,
        drain_margin_s: float | None = None,
        interleave_by_agent: bool = False,
        retry_requests: bool = True,
        enrich_results: bool = False,
        include_model_call_payloads: bool = True,
        delete_model_call_capture: bool = False,
        record_output_dir: str | os.PathLike[str] | None = None,
        record_shard: str | None = None,
        record_omitted_rollouts: bool = False,
    ) -> DispatchIterator[Row, tuple[Row, Row | RolloutFailureRecord]]:
        """``async for row, outcome in helper.run_outcomes(rows)``: typed outcomes in completion order.

        ``outcome`` is the completed record (the result plus the row's identity keys,
        ``_ng_environment_server`` and ``_ng_result_type``, as recording writes it; a drained row's record
        carries ``_ng_no_persist``) or a :class:`RolloutFailureRecord` for an expected HTTP / JSON /
        result-shape failure (error status, no answer, bad JSON, non-object reply, episode failure, reserved
        result keys). Programming errors and cancellation propagate. Nothing is persisted or retried.

        The rows handed back are this invocation's shallow copies stamped with ``_ng_run_id``: ``run_id``
        when given (overriding row stamps), else the row's own stamp, else one fresh id shared by this
        call. Input rows are never modified. Call :meth:`preprocess_examples` first, or give rows stable
        explicit rollout ids. ``enrich_results`` adds ``ng_model_call_capture`` / ``ng_trajectory`` /
        ``ng_perf`` to completed records (see :meth:`run_examples`). ``record_output_dir`` /
        ``record_shard`` / ``record_omitted_rollouts`` record the shard as in :meth:`run_examples`; the
        shard's run id is then ``run_id`` (else the one the shard was recorded with, else a fresh one) and
        names every row copy. Other arguments and closing are as in :meth:`run_examples`.
        """
        recorder = _recorder_for(record_output_dir, record_shard, run_id, record_omitted_rollouts)
        if run_id is not None:
            invocation_id = run_id
        else:
            invocation_id = recorder.run_id if recorder is not None else uuid.uuid4().hex

        def stamped(rows: Iterable[Mapping[str, Any]]) -> Iterator[Row]:
            for row in rows:
                own = row.get(keys.RUN_ID)
                rid = run_id if run_id is not None else (own if isinstance(own, str) else invocation_id)
                yield {**row, keys.RUN_ID: rid}

        return self._iterator(
            stamped(examples),
            shape="outcomes",
            head_server_config=head_server_config,
            semaphore=semaphore,
            route_failures_to_sidecar=True,
            record_unrouted_failures=False,
            record_failure=None,
            environment_server_name=environment_server_name,
            max_resident_tasks=max_resident_tasks,
            dispatch_budget_s=dispatch_budget_s,
            drain_margin_s=drain_margin_s,
            interleave=interleave_by_agent,
            retry_requests=retry_requests,
            batch_size=len(examples) if isinstance(examples, Sequence) else VALIDATION_BATCH,
            enrich=_enrich_options(
                enrich_results or recorder is not None, include_model_call_payloads, delete_model_call_capture
            ),
            recorder=recorder,
        )


def _recorder_for(
    run_dir: str | os.PathLike[str] | None, shard: str | None, run_id: str | None, keep_omitted: bool
) -> ShardRecorder | None:
    if run_dir is None and shard is None:
        return None
    if run_dir is None or shard is None:
        raise UsageError(
            f"record_output_dir={run_dir!r} and record_shard={shard!r}: recording needs both, the run "
            "folder and the shard label (e.g. record_output_dir='runs/r1', record_shard='shard-0000')"
        )
    return ShardRecorder(run_dir, shard, run_id=run_id, record_omitted_rollouts=keep_omitted)


def _enrich_options(enrich: bool, include_payloads: bool, delete_capture: bool) -> tuple[bool, bool] | None:
    check_capture_options(
        include_model_call_payloads=include_payloads, delete_model_call_capture=delete_capture
    )
    return (include_payloads, delete_capture) if enrich else None


def _enriching(
    runner: Any, *, include_payloads: bool, delete_capture: bool
) -> Callable[[Row], Coroutine[Any, Any, tuple[Row, Any]]]:
    """Wrap a ``completed``-shape row runner: each ``CompletedRollout`` becomes its enriched record."""

    seen: list[Any] = [None, False]  # (topology, its observability_enabled): raw is a deep copy, read once

    async def run(row: Row) -> tuple[Row, Any]:
        row, outcome = await runner.run(row)
        if isinstance(outcome, RolloutFailureRecord):
            return row, outcome
        record = build_record(
            row,
            outcome.result,
            environment_server=outcome.environment_server,
            result_type=outcome.environment_server_type,
        )
        if seen[0] is not runner.topology:
            seen[:] = [runner.topology, bool(runner.topology.raw.get(OBSERVABILITY_ENABLED))]
        observe: bool = seen[1]
        kw: dict[str, Any] = {
            "include_model_call_payloads": include_payloads,
            "observability_enabled": observe,
            "delete_model_call_capture": delete_capture,
            "total_latency_ms": outcome.rollout_latency_ms,
        }
        if needs_io(record, observability_enabled=observe):
            return row, await asyncio.to_thread(enrich_run_result, row, record, **kw)
        return row, enrich_run_result(row, record, **kw)

    return run

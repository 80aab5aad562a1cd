"""The coordinator: learns of each finished shard, keeps the run's status, finalizes the run (the run's
coordinator actor is this class made remote, on the caller's node by default).

Workers send one :class:`~gym_ray.run.result.ShardReport` per shard they ran (with that call's successes by
environment server and reward sums, for the live progress view); the driver sends each planned
:class:`~gym_ray.run.collect.ShardSpec` as it is planned and ``None`` when planning ends. At the end,
:meth:`RunCoordinator.finalize` rebuilds the :class:`~gym_ray.run.collect.RunPlan` from those specs and runs
:func:`gym_ray.run.finalize.finalize_run` (k-way merge of the shard files, completion check,
``/aggregate_metrics`` once per environment server, metrics file, ``rollouts_summary.json``) in this actor
with its own client pool, then adds the distributed figures (workers, shard timings) under the
``"distributed"`` key of the summary (atomic replace).

Counting promise: a report counts only what its ``run_shard`` call wrote (``succeeded``/``failed``), so the
sums stay exact when a shard is run again after its worker died (the re-run finds the recorded rollouts
done and writes only the rest). The figures on disk (the merged files) remain the source of truth.

Ray resources: IO bound (``num_cpus=0``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gym_ray.distributed.journal import ControlJournal
from gym_ray.record.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.finalize.aggregate_ahead import AggregationAhead
    from gym_ray.finalize.metrics_summary import WrittenSummary
    from gym_ray.run.collect import RunPlan, ShardSpec
    from gym_ray.run.result import RunResult, ShardReport

logger = logging.getLogger(__name__)

#: Summary file key holding the distributed figures.
DISTRIBUTED_KEY = "distributed"


def coordinator_max_concurrency(num_workers: int, shards_per_worker: int) -> int:
    """The coordinator actor's ``max_concurrency``: every worker lane's report may arrive at once (through
    the driver), plus progress polls and control calls."""
    return num_workers * shards_per_worker + 16


class FinalizeFn(Protocol):
    """The shape of :func:`gym_ray.run.finalize.finalize_run`."""

    def __call__(
        self,
        plan: RunPlan,
        reports: Iterable[ShardReport],
        *,
        run: RunConfig,
        client: ServerClient,
        wall_s: float,
        num_workers: int = 1,
        counts_from_reports: bool = False,
    ) -> Awaitable[RunResult]: ...


@dataclass(frozen=True)
class ShardTiming:
    """When and where one shard ran (for straggler analysis and benchmarks)."""

    shard: str
    worker: str | None
    wall_s: float
    dispatched: int
    reported_at_s: float


@dataclass(frozen=True)
class RunStatus:
    """The run as the coordinator knows it."""

    shards_done: int
    shards_planned: int
    plan_done: bool
    rows_planned: int
    succeeded: int
    failed: int
    dispatched: int
    already_done: int
    failed_by_class: dict[str, int]
    elapsed_s: float
    rollouts_per_s: float
    workers_reporting: tuple[str, ...]
    by_server: dict[str, tuple[int, float]] = field(default_factory=dict)
    rows_total: int | None = None


def _default_finalize() -> FinalizeFn:
    from gym_ray.run.finalize import finalize_run

    return finalize_run


class RunCoordinator:
    """Records shard reports, keeps the run status, and finalizes the run.

    Run as a Ray async actor (``ray.remote(RunCoordinator).options(num_cpus=0, max_concurrency=...)``, see
    :func:`coordinator_max_concurrency`); plain Python, so it also works in one event loop.

    Args:
        run_dir: The run folder.
        config: The plain global config (the topology is built from it for finalization).
        settings: The run's settings.
        finalize_fn: Merges and aggregates the run; :func:`gym_ray.run.finalize.finalize_run` by default.
        client_factory: Builds the client pool used to aggregate.
        clock: Monotonic clock, injected for tests; elapsed time counts from construction.
        journal: This run call's coordinator journal (see :mod:`gym_ray.distributed.journal`): every
            planned shard and accepted report is written there before it counts, and a coordinator built
            on a journal that holds lines (its process was restarted) counts them again from it, so its
            status, plan and finalization are the dead process's. A shard's report counts once however
            often it is delivered. ``None``: no journal (a restart would start from nothing).
    """

    def __init__(
        self,
        run_dir: str,
        run: RunConfig,
        *,
        finalize_fn: FinalizeFn | None = None,
        client_factory: Callable[[RunConfig], ServerClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        journal: str | None = None,
    ) -> None:
        self._mirror = None
        if run.store_url is not None:  # a folder on an object store: this actor's own local copy of it
            from gym_ray.store.mirror import localize, mirror_of

            self._mirror = mirror_of(run.store_url)
            run = localize(run)
            run_dir = str(self._mirror.stage)
        self._run_dir = run_dir
        self._run = run
        self._settings = run.settings
        self._finalize_fn = finalize_fn or _default_finalize()
        self._client_factory = client_factory
        self._clock = clock
        self._started = clock()
        self._shards_done: set[str] = set()
        self._timings: list[ShardTiming] = []
        self._succeeded = self._failed = self._dispatched = self._already_done = 0
        self._failed_by_class: Counter[str] = Counter()
        self._workers: set[str] = set()
        self._reports: list[ShardReport] = []
        self._specs: list[ShardSpec] = []
        self._planned_shards: set[str] = set()
        self._rows_planned = 0
        self._rows_total: int | None = None
        self._plan_done = False
        self._by_server: dict[str, list[float]] = {}
        # merge work done while the run goes on (gym_ray.finalize.merge_ahead): finished shards, reduced
        # one after the other in a thread by one owned task
        self._ahead: deque[str] = deque()
        self._ahead_wake: asyncio.Event | None = None
        self._ahead_task: asyncio.Task[None] | None = None
        self._ahead_stop = False
        self.reduced_ahead = 0
        self.grouped_ahead = 0
        self._aggregation_ahead: AggregationAhead | None = None
        self._journal: ControlJournal | None = None
        if journal is not None:
            self._take_up(ControlJournal(journal))

    def _take_up(self, journal: ControlJournal) -> None:
        """Count again what a dead process of this actor had counted (a restart), then journal from here."""
        entries = journal.entries()
        for entry in entries:
            if "started_wall" in entry:  # elapsed time counts from the first process's start
                self._started = self._clock() - max(0.0, time.time() - entry["started_wall"])
            elif "spec" in entry:
                self._add_spec(_spec_of(entry["spec"]))
            elif "plan_done" in entry:
                self._plan_done = True
            elif "report" in entry:
                self._count(_report_of(entry["report"]), entry["by_server"], entry["at"])
        self._journal = journal
        if entries:
            logger.warning(
                "coordinator: restarted; took up %d planned shards and %d shard reports from %s",
                len(self._specs),
                len(self._reports),
                journal.path,
            )
        else:
            journal.append({"started_wall": time.time()})

    def _reduce_ahead_later(self, shard: str) -> None:
        """Queue a finished shard for its reduction ahead of the merge (needs the actor's running loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a plain call): the merge reduces the shard itself
        if self._ahead_stop:
            return
        self._ahead.append(shard)
        if self._ahead_task is None:
            self._ahead_wake = asyncio.Event()
            self._ahead_task = loop.create_task(self._reduce_ahead_loop())
        assert self._ahead_wake is not None
        self._ahead_wake.set()

    async def _reduce_ahead_loop(self) -> None:
        from gym_ray.finalize import aggregate_ahead
        from gym_ray.finalize.merge_ahead import grow_prefix, reduce_ahead

        if not self._settings.disable_aggregation:
            # the prefix's rows grouped for /aggregate_metrics as it grows; the run's aggregate takes it over
            self._aggregation_ahead = aggregate_ahead.AggregationAhead(self._run_dir, self._run.topology)
            aggregate_ahead.register(self._run_dir, self._aggregation_ahead)

        def reduce_and_grow(shard: str, planned: tuple[str, ...]) -> bool:
            if self._mirror is not None:
                self._mirror.pull_shard(shard)
            stored = reduce_ahead(self._run_dir, shard)
            if stored:
                grow_prefix(self._run_dir, planned)
                if self._aggregation_ahead is not None:
                    self._aggregation_ahead.feed()
            return stored

        assert self._ahead_wake is not None
        while not self._ahead_stop:
            if not self._ahead:
                self._ahead_wake.clear()
                await self._ahead_wake.wait()
                continue
            shard = self._ahead.popleft()
            try:
                planned = tuple(spec.shard for spec in self._specs)
                if await asyncio.to_thread(reduce_and_grow, shard, planned):
                    self.reduced_ahead += 1
            except Exception as exc:  # the final merge reduces the shard itself and reports any error
                logger.info("coordinator: shard %s not reduced ahead of the merge: %s", shard, exc)

    async def _stop_reducing_ahead(self) -> None:
        """Let the reduction under way finish, drop the queued ones (the merge does them), join the task."""
        self._ahead_stop = True
        self._ahead.clear()
        task, self._ahead_task = self._ahead_task, None
        if task is None:
            return
        assert self._ahead_wake is not None
        self._ahead_wake.set()
        await task

    def node_id(self) -> str:
        """The Ray node (hex id) this actor runs on."""
        from gym_ray.distributed.placement import current_node_id

        return current_node_id()

    def pid(self) -> int:
        """This actor's process id (benchmarks sample its memory)."""
        return os.getpid()

    async def close(self) -> None:
        """Flush and shut down this process's telemetry before the actor is killed (idempotent; a no-op
        when nothing was traced here). See :func:`gym_ray.observe.tracing.shutdown_tracing`."""
        from gym_ray.observe.tracing_gate import shutdown_tracing_if_used
        from gym_ray.store import release_stages

        await self._stop_reducing_ahead()
        if self._aggregation_ahead is not None:  # not taken by a finalize: its spools go
            from gym_ray.finalize import aggregate_ahead

            if aggregate_ahead.claim(self._run_dir) is not None:
                self._aggregation_ahead.discard()
        await asyncio.to_thread(shutdown_tracing_if_used)
        release_stages()  # this process's copy of a store folder, if any

    def record_report(
        self, report: ShardReport, by_server: Mapping[str, tuple[int, float]] | None = None
    ) -> None:
        """Count one shard's report (idempotent per shard for ``shards_done``; counts add up, see module).

        Called by the driver actor under its hand-out lock, only for a completion it accepts
        (:meth:`~gym_ray.distributed.driver.RunDriver.report_shard`).

        Args:
            report: What the shard's ``run_shard`` call did.
            by_server: That call's successes as ``{environment server: (count, reward sum)}`` (live
                progress; see :class:`~gym_ray.distributed.worker.OutcomeTally`).
        """
        if report.shard in self._shards_done:
            # sent again by Ray after this actor's or the driver's process died before answering
            logger.info("coordinator: shard %s was counted already; not counted again", report.shard)
            return
        at = self._clock() - self._started
        if self._journal is not None:
            self._journal.append(
                {"report": report.model_dump(mode="json"), "by_server": dict(by_server or {}), "at": at}
            )
        self._count(report, by_server, at)
        self._reduce_ahead_later(report.shard)

    def _count(self, report: ShardReport, by_server: Mapping[str, Sequence[float]] | None, at: float) -> None:
        self._shards_done.add(report.shard)
        for server, (count, reward) in (by_server or {}).items():
            entry = self._by_server.setdefault(server, [0, 0.0])
            entry[0] += count
            entry[1] += reward
        self._reports.append(report)
        self._succeeded += report.succeeded
        self._failed += report.failed
        self._dispatched += report.dispatched
        self._already_done += report.already_done
        self._failed_by_class.update(report.failed_by_class)
        if report.worker is not None:
            self._workers.add(report.worker)
        self._timings.append(
            ShardTiming(
                shard=report.shard,
                worker=report.worker,
                wall_s=report.wall_s,
                dispatched=report.dispatched,
                reported_at_s=at,
            )
        )

    async def plan_progress(self, spec: ShardSpec | None) -> None:
        """The driver's planning progress: one more planned shard, or ``None`` when planning ended."""
        if spec is None:
            if not self._plan_done and self._journal is not None:
                self._journal.append({"plan_done": True})
            self._plan_done = True
            return
        if spec.shard in self._planned_shards:
            return  # a restarted driver plans the folder again: the shard is known
        if self._journal is not None:
            self._journal.append({"spec": dataclasses.asdict(spec)})
        self._add_spec(spec)

    def _add_spec(self, spec: ShardSpec) -> None:
        if self._mirror is not None:  # planned in the driver's copy of a store folder: read in this one
            spec = replace(spec, run_dir=self._run_dir)
        self._planned_shards.add(spec.shard)
        self._specs.append(spec)
        self._rows_planned += spec.num_rows
        if spec.run_rows is not None:
            self._rows_total = spec.run_rows

    async def status(self) -> RunStatus:
        """The run's status now."""
        elapsed = self._clock() - self._started
        finished = self._succeeded + self._failed
        return RunStatus(
            shards_done=len(self._shards_done),
            shards_planned=len(self._specs),
            plan_done=self._plan_done,
            rows_planned=self._rows_planned,
            succeeded=self._succeeded,
            failed=self._failed,
            dispatched=self._dispatched,
            already_done=self._already_done,
            failed_by_class=dict(self._failed_by_class),
            elapsed_s=elapsed,
            rollouts_per_s=finished / elapsed if elapsed > 0 else 0.0,
            workers_reporting=tuple(sorted(self._workers)),
            by_server={k: (int(n), float(r)) for k, (n, r) in self._by_server.items()},
            rows_total=self._rows_total if not self._plan_done else self._rows_planned,
        )

    async def timings(self) -> list[ShardTiming]:
        """Every shard report's timing, in arrival order."""
        return list(self._timings)

    async def written_metrics_summary(self) -> WrittenSummary | None:
        """The summary of the metrics file this process wrote last (after :meth:`finalize`: the run's), so
        the caller can print the run's headline without reading the file (see
        :func:`gym_ray.finalize.aggregate.adopt_written_summary`)."""
        from gym_ray.finalize.metrics_summary import written_summary

        return written_summary()

    async def finalize(
        self, *, num_workers: int, wall_s: float | None = None, counts_from_reports: bool = False
    ) -> RunResult:
        """Merge the shards, aggregate metrics once per environment server, write the summary.

        Call once, after every worker returned. The summary gains a ``"distributed"`` entry with the worker
        count, this call's counts, rollouts/s and wall time, and the shard timings.

        Args:
            num_workers: Workers the run started with.
            wall_s: The run's wall time so far as the caller measured it (default: since this actor started).
            counts_from_reports: Every shard was handed out once and no worker was lost, so each shard's
                one report counted its rows under the shard's lock (see ``finalize_run``); else the shards
                are read again for the closing counts.

        Raises:
            AggregationError / RecordError: From ``finalize_run``; the run folder stays resumable.
        """
        factory = self._client_factory or _default_client
        if wall_s is None:
            wall_s = self._clock() - self._started
        await self._stop_reducing_ahead()  # the merge must not race a reduction
        ahead = self._aggregation_ahead
        self.grouped_ahead = 0 if ahead is None else ahead.rows_grouped
        logger.info(
            "coordinator: %d shards were reduced ahead of the merge, %d rows grouped ahead of the aggregate",
            self.reduced_ahead,
            self.grouped_ahead,
        )
        mirror = self._mirror
        if mirror is not None:  # the whole folder here: every file, and each shard's committed records
            await asyncio.to_thread(lambda: mirror.pull_all(outputs=False))
        try:
            async with factory(self._run) as client:
                result = await self._finalize_fn(
                    self._plan(),
                    list(self._reports),
                    run=self._run,
                    client=client,
                    wall_s=wall_s,
                    num_workers=num_workers,
                    counts_from_reports=counts_from_reports,
                )
            status = await self.status()
            self._write_distributed_summary(
                Path(result.summary_path), status, num_workers=num_workers, wall_s=wall_s
            )
        finally:
            if mirror is not None:  # outputs, metrics, state and summary (last), each one whole object
                await asyncio.to_thread(mirror.push_changed)
        if mirror is not None:
            result = mirror.published(result)
        logger.info(
            "coordinator: run %s finalized: %d succeeded, %d failed (this call), %.1f rollouts/s, %d workers",
            result.run_id,
            status.succeeded,
            status.failed,
            status.rollouts_per_s,
            num_workers,
        )
        return result

    def _plan(self) -> RunPlan:
        """The run's plan as the driver announced it (run id from the specs, else the run manifest)."""
        from gym_ray.plan.run_manifest import RUN_MANIFEST
        from gym_ray.plan.shards import RunPlan

        if self._specs:
            run_id, identity = self._specs[0].run_id, self._specs[0].config_identity
        else:
            manifest = json.loads((Path(self._run_dir) / RUN_MANIFEST).read_text(encoding="utf-8"))
            run_id, identity = str(manifest["run_id"]), manifest.get("config_identity")
        return RunPlan(
            run_dir=self._run_dir,
            run_id=run_id,
            config_identity=identity,
            planned=self._rows_planned,
            shards=tuple(self._specs),
            resumed=any(report.already_done for report in self._reports),
        )

    def _write_distributed_summary(
        self, path: Path, status: RunStatus, *, num_workers: int, wall_s: float
    ) -> None:
        summary: dict[str, Any] = {}
        if path.exists():
            loaded = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                summary = loaded
        summary[DISTRIBUTED_KEY] = {
            "num_workers": num_workers,
            "workers_reporting": list(status.workers_reporting),
            "shards_reported": len(self._timings),
            "succeeded": status.succeeded,
            "failed": status.failed,
            "failed_by_class": status.failed_by_class,
            "dispatched": status.dispatched,
            "already_done": status.already_done,
            "wall_s": round(wall_s, 3),
            "rollouts_per_s": round((status.succeeded + status.failed) / wall_s, 3) if wall_s > 0 else 0.0,
            "shards_reduced_ahead_of_the_merge": self.reduced_ahead,
            "rows_grouped_ahead_of_the_aggregate": self.grouped_ahead,
            "shard_timings": [
                {
                    "shard": t.shard,
                    "worker": t.worker,
                    "wall_s": round(t.wall_s, 4),
                    "dispatched": t.dispatched,
                }
                for t in self._timings
            ],
        }
        atomic_write_bytes(path, (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())


def _spec_of(fields: dict[str, Any]) -> ShardSpec:
    from gym_ray.plan.shards import ShardSpec

    return ShardSpec(**fields)


def _report_of(fields: dict[str, Any]) -> ShardReport:
    from gym_ray.run.result import ShardReport

    return ShardReport.model_validate(fields)


def _default_client(run: RunConfig) -> ServerClient:
    from gym_ray.dispatch.pool import client_for  # not run.collect: no dispatch engine in this process

    return client_for(run)

"""Recording a helper dispatch into one shard of a run folder (``run_examples(record_output_dir=...)``).

:class:`ShardRecorder` is the glue between :class:`~gym_ray.dispatch.helper.RolloutCollectionHelper` and
the shard
writer: it stamps the caller's rows as copies naming the shard's run, writes them as the shard's
materialized inputs and manifest before the first row is admitted, appends each outcome's record from the
row's own task (so a rollout that finished is on disk even when no consumer claimed it), and writes the
shard's progress and closes the writer once no row task can append any more.

A shard that already holds records is *resumed*, as collection resumes a shard: the rows given must be the
shard's rows (each row agrees with its materialized row on every key the caller gave, and the rows to run
are byte for byte what ``plan_resume`` yields, stamped with the shard's run id); then only what is missing
runs, each row with its attempt index, and the manifest is written again with every row's attempt
reserved. Other rows are refused (:class:`~gym_ray.errors.ResumeError`) as other materialized inputs.

Takeover: the shard's writer is opened when the first row is pulled, before the resume is planned, so the
last caller to record a shard holds it: an older writer of the same shard (a zombie still running) gets
:class:`~gym_ray.errors.ShardLockError` on its next write and adds nothing (see
:mod:`gym_ray.record.writer`).

Durability and concurrency promises: those of :class:`~gym_ray.record.writer.ShardWriter` (locked, whole-line
appends, fsync at checkpoints and on close). The recorder lives on one event loop; its counters are not
guarded. Accepted trade-off: the rows are materialized as a list before dispatch (the inputs file is
written whole and atomically, before any row runs), so memory grows with the number of rows recorded;
record large inputs through collection (``gym-ray run``), which streams them into shards.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord, record_of
from gym_ray.errors import InputError, ResumeError, UsageError
from gym_ray.plan.resume import ResumePlan, plan_resume
from gym_ray.record.jsonl import JsonlReader, encode_line
from gym_ray.record.manifest import ShardManifest, read_manifest
from gym_ray.record.shard_files import record_identity, shard_paths
from gym_ray.record.writer import ShardWriter

Row = dict[str, Any]
RowRunner = Callable[[Row], Coroutine[Any, Any, tuple[Row, Any]]]
FailureHook = Callable[[Row, Row], Awaitable[None] | None]


_MISSING = object()


def _as_json(row: Row) -> Row:
    """The row as it reads back from a JSONL file (tuples become lists, and so on)."""
    try:
        loaded: Row = json.loads(encode_line(row))
    except (TypeError, ValueError):
        return row
    return loaded


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


class ShardRecorder:
    """Records one helper call's rows and outcomes as shard ``shard`` of ``run_dir`` (or resumes it).

    Args:
        run_dir: The run folder (created when the shard is started).
        shard: The shard label (validated now).
        run_id: The shard's run id: stamped on every row copy and prefixed to its rollout id. None: the
            run id the shard was recorded with when it holds records, else a fresh one.
        record_omitted_rollouts: Keep drained rows in the failures sidecar (see ``ShardWriter``).
        max_rollout_attempts: The attempt cap written into the manifest and applied on resume.

    Raises:
        ConfigError: The shard label is not valid.
        ResumeError: The shard was recorded under another run id than ``run_id``, or holds records it
            cannot be resumed from (no materialized inputs).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        shard: str,
        *,
        run_id: str | None = None,
        record_omitted_rollouts: bool = False,
        max_rollout_attempts: int = 3,
    ) -> None:
        self.paths = shard_paths(run_dir, shard)
        self.shard = shard
        recorded = self._recorded_run_id()
        if run_id is not None and recorded is not None and run_id != recorded:
            raise ResumeError(
                f"record_shard={shard!r}: {self.paths.run_dir} holds that shard recorded under run id "
                f"{recorded!r}, so run_id={run_id!r} names other rows; pass run_id={recorded!r} (or none) "
                "to resume it, or record into a new shard label or folder"
            )
        self.run_id = run_id if run_id is not None else recorded if recorded is not None else uuid.uuid4().hex
        self.max_rollout_attempts = max_rollout_attempts
        self._writer = ShardWriter(
            run_dir,
            shard,
            run_id=self.run_id,
            config_identity=None,
            record_omitted_rollouts=record_omitted_rollouts,
        )
        self._total = 0
        self._settled = 0
        self._active = 0
        self._closing = False
        self._opened = False
        self._started = False
        self._finished = False
        self._stale = False
        self._resume: ResumePlan | None = None
        if _non_empty(self.paths.successes) or _non_empty(self.paths.failures):
            if not self.paths.materialized_inputs.exists():
                raise ResumeError(
                    f"record_shard={shard!r}: {self.paths.run_dir} holds records of that shard but not its "
                    f"materialized inputs ({self.paths.materialized_inputs.name}), so it cannot be resumed; "
                    "restore that file, or record into a new shard label or folder"
                )

    def _recorded_run_id(self) -> str | None:
        """The run id the shard was recorded with: its manifest's, else its first materialized row's."""
        try:
            manifest = read_manifest(self.paths.run_dir, self.shard)
        except InputError as exc:
            raise ResumeError(f"record_shard={self.shard!r}: {exc}") from exc
        if manifest is not None:
            return manifest.run_id
        if not self.paths.materialized_inputs.exists():
            return None
        for _, row in JsonlReader(self.paths.materialized_inputs, strict=True):
            run_id = row.get(keys.RUN_ID)
            return run_id if isinstance(run_id, str) else None
        return None

    def _check_same_rows(self, copies: list[Row]) -> None:
        """Refuse rows that are not the shard's materialized rows (compared on every key the caller gave).

        ``_ng_environment_server`` is left out (``environment_server_name`` overrides it on the dispatched
        copy); the rows that run again are compared byte for byte in :meth:`start`.
        """
        inputs = self.paths.materialized_inputs
        recorded = [row for _, row in JsonlReader(inputs, strict=True)]
        problem = None
        if len(recorded) != len(copies):
            problem = f"it holds {len(recorded)} rows, this call gave {len(copies)}"
        else:
            for number, (copy, row) in enumerate(zip(copies, recorded, strict=True)):
                given = _as_json(copy)
                differing = sorted(
                    k for k, v in given.items() if k != keys.ENVIRONMENT_SERVER and row.get(k, _MISSING) != v
                )
                if differing:
                    problem = f"row {number} differs in {', '.join(differing)}"
                    break
        if problem is not None:
            raise self._other_inputs(problem)

    def _other_inputs(self, problem: str) -> ResumeError:
        return ResumeError(
            f"record_shard={self.shard!r}: {self.paths.run_dir} already holds that shard, recorded from "
            f"other rows ({self.paths.materialized_inputs.name}: {problem}); these are other materialized "
            "inputs, so this call cannot resume the shard. Pass the shard's own rows to resume it, or "
            "record into a new shard label or folder"
        )

    def stamp(self, rows: Iterable[Mapping[str, Any]]) -> list[Row]:
        """Copies of ``rows`` naming this shard's run, each rollout id prefixed with the run id.

        A row's own id is its ``_ng_rollout_id``, else ``<task>-<rollout>`` (plus ``-a<n>`` for an
        attempt index); the copy's id is ``<run_id>-<own id>``. Input rows are not modified.

        Raises:
            InputError: A row is not a dict, or has no integer ``_ng_task_index`` / ``_ng_rollout_index``
                (names the row number).
        """
        copies: list[Row] = []
        for number, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise InputError(
                    f"row {number} is a {type(row).__name__}, not an object; rows must be dicts", row=number
                )
            identity = record_identity(row)
            if identity is None:
                raise InputError(
                    f"row {number} has {keys.TASK_INDEX}={row.get(keys.TASK_INDEX)!r} and "
                    f"{keys.ROLLOUT_INDEX}={row.get(keys.ROLLOUT_INDEX)!r}; recording shard {self.shard!r} "
                    "needs integer rollout identities: call preprocess_examples first",
                    row=number,
                )
            own = row.get(keys.ROLLOUT_ID)
            if not isinstance(own, str):
                attempt = row.get(keys.ATTEMPT_INDEX)
                own = keys.default_rollout_id(*identity, attempt if type(attempt) is int else 0)
            copies.append({**row, keys.RUN_ID: self.run_id, keys.ROLLOUT_ID: f"{self.run_id}-{own}"})
        self._total = len(copies)
        if self.paths.materialized_inputs.exists():
            self._check_same_rows(copies)  # refuse other rows at call; checked again once the shard is held
        return copies

    def rows_to_run(self, copies: list[Row]) -> Iterator[Row]:
        """The rows this call runs, computed when the first one is pulled (lazily, at first consumption).

        Pulling the first row opens the shard's writer (taking the shard over from any older writer).
        A fresh shard runs every copy; a shard holding materialized inputs is resumed: ``copies`` must be
        its rows, and only the rows ``plan_resume`` reports pending run, with their attempt index.

        Raises:
            ResumeError: The copies are other rows than the shard's, or the shard cannot be resumed.
            ShardIOError: The writer could not be opened.
        """
        if not copies and not self.paths.materialized_inputs.exists():
            return
        self._writer.open()
        self._opened = True
        if not self.paths.materialized_inputs.exists():
            yield from copies
            return
        # An error here leaves the shard unstarted (no start(), no resume plan), so closing the recorder
        # writes no progress and just closes the writer.
        self._check_same_rows(copies)
        plan = plan_resume(self.paths.run_dir, self.shard, max_rollout_attempts=self.max_rollout_attempts)
        self._resume = plan
        pending = plan.pending
        self._total = len(pending)
        yield from pending

    def start(self, rows: list[Row], *, config_identity: str | None) -> None:
        """Write the shard's materialized inputs and manifest (fresh), or check a resume's rows (resume).

        Called once, with the validated rows of :meth:`rows_to_run`, before the first row is admitted.
        A fresh shard gets ``rows`` as its materialized inputs, then its manifest. A resumed shard's rows
        must be byte for byte the pending rows of its materialized inputs and its config identity the
        recorded one; its manifest is written again with each row's next attempt reserved.

        Raises:
            ResumeError: Resuming with other rows or under another config.
            ShardLockError, ShardIOError: As raised by the writer.
        """
        if self._started:
            raise UsageError(f"shard {self.shard!r}: rows are recorded once per call; start() ran already")
        self._started = True
        try:
            prior = None
            if self._resume is None:
                self._writer.write_materialized_inputs(rows)
            else:
                prior = self._check_resume(rows, config_identity)
            self._writer.write_manifest(
                ShardManifest.build(
                    run_id=self.run_id,
                    shard=self.shard,
                    config_identity=config_identity,
                    inputs_path=self.paths.materialized_inputs,
                    max_rollout_attempts=self.max_rollout_attempts,
                    prior_attempts=prior,
                )
            )
        except Exception:
            self._stale = True  # no row runs; closing only closes the writer
            raise

    def _check_resume(self, rows: list[Row], config_identity: str | None) -> Mapping[tuple[int, int], int]:
        """Check the validated rows of a resume and return the attempts recorded so far per identity."""
        plan = plan_resume(
            self.paths.run_dir,
            self.shard,
            max_rollout_attempts=self.max_rollout_attempts,
            config_identity=config_identity,
        )
        expected = [encode_line(row) for row in plan.iter_pending()]
        if len(expected) != len(rows):
            raise self._other_inputs(f"{len(expected)} rows are pending, this call would run {len(rows)}")
        for number, (row, line) in enumerate(zip(rows, expected, strict=True)):
            if encode_line(row) != line:
                raise self._other_inputs(f"pending row {number} differs once validated against the config")
        return plan.attempts

    # --- per row --------------------------------------------------------------------------------

    def enter(self) -> None:
        """A row task began (pair with :meth:`leave` in its ``finally``)."""
        self._active += 1

    def leave(self) -> None:
        """A row task ended, whatever its outcome; the last one finishes the shard."""
        self._active -= 1
        self._settled += 1
        if self._settled >= self._total or self._closing:
            self._finish_when_idle()

    def record(self, row: Mapping[str, Any], outcome: Row | CompletedRollout | RolloutFailureRecord) -> None:
        """Append one outcome: a record dict as is, else :func:`~gym_ray.dispatch.outcomes.record_of` of it.

        Raises:
            ShardLockError: Another writer opened the shard since (this writer is stale).
            ShardIOError: The write failed; the shard is failed.
        """
        record = outcome if isinstance(outcome, dict) else record_of(row, outcome)
        self._append(record)

    def record_failure_row(self, row: Mapping[str, Any], failure_row: Row) -> None:
        """Keep an unrouted ``/run`` failure (its sidecar line) before the dispatch raises the error."""
        self._append(failure_row)

    def _append(self, record: Row) -> None:
        try:
            self._writer.append(record)
        except Exception:
            self._stale = True
            raise

    def wrap(self, run: RowRunner) -> RowRunner:
        """Wrap a row runner: each outcome is appended to the shard from the row's own task."""

        async def recorded(row: Row) -> tuple[Row, Any]:
            self.enter()
            try:
                row, outcome = await run(row)
                self.record(row, outcome)
                return row, outcome
            finally:
                self.leave()

        return recorded

    def failure_recorder(self, then: FailureHook | None) -> FailureHook:
        """A dispatch ``record_failure`` hook: append the failure row to the sidecar, then call ``then``."""

        async def keep(row: Row, failure_row: Row) -> None:
            self.record_failure_row(row, failure_row)
            if then is not None:
                pending = then(row, failure_row)
                if pending is not None:
                    await pending

        return keep

    # --- closing --------------------------------------------------------------------------------

    def closing(self) -> None:
        """The iterator closed: finish now if no row task is running, else when the last one ends."""
        self._closing = True
        self._finish_when_idle()

    def _finish_when_idle(self) -> None:
        if self._active > 0 or self._finished:
            return
        self._finished = True
        if not self._opened:
            return
        try:
            if not self._stale and (self._started or self._resume is not None):
                self._writer.write_progress()
        finally:
            self._writer.close()

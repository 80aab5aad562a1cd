"""Recording a helper dispatch into one shard of a run folder (``run_examples(record_output_dir=...)``).

:class:`ShardRecorder` is the glue between :class:`~gym_ray.dispatch.helper.RolloutCollectionHelper` and
the shard
writer: it stamps the caller's rows as copies naming the shard's run, writes them as the shard's
materialized inputs and manifest before the first row is admitted, appends each outcome's record from the
row's own task (so a rollout that finished is on disk even when no consumer claimed it), and writes the
shard's progress and closes the writer once no row task can append any more.

Durability and concurrency promises: those of :class:`~gym_ray.record.writer.ShardWriter` (locked, whole-line
appends, fsync at checkpoints and on close). The recorder lives on one event loop; its counters are not
guarded. Accepted trade-off: the rows are materialized as a list before dispatch (the inputs file is
written whole and atomically, before any row runs), so memory grows with the number of rows recorded;
record large inputs through collection (``gym-ray run``), which streams them into shards.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord, record_of
from gym_ray.errors import InputError, UsageError
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import record_identity, shard_paths
from gym_ray.record.writer import ShardWriter

Row = dict[str, Any]
RowRunner = Callable[[Row], Coroutine[Any, Any, tuple[Row, Any]]]
FailureHook = Callable[[Row, Row], Awaitable[None] | None]


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


class ShardRecorder:
    """Records one helper call's rows and outcomes as shard ``shard`` of ``run_dir``.

    Args:
        run_dir: The run folder (created when the shard is started).
        shard: The shard label (validated now).
        run_id: The shard's run id: stamped on every row copy and prefixed to its rollout id.
        record_omitted_rollouts: Keep drained rows in the failures sidecar (see ``ShardWriter``).
        max_rollout_attempts: The attempt cap written into the manifest.

    Raises:
        ConfigError: The shard label is not valid.
        UsageError: The shard already holds recorded files.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        shard: str,
        *,
        run_id: str,
        record_omitted_rollouts: bool = False,
        max_rollout_attempts: int = 3,
    ) -> None:
        self.paths = shard_paths(run_dir, shard)
        self.shard = shard
        self.run_id = run_id
        self.max_rollout_attempts = max_rollout_attempts
        self._writer = ShardWriter(
            run_dir,
            shard,
            run_id=run_id,
            config_identity=None,
            record_omitted_rollouts=record_omitted_rollouts,
        )
        self._total = 0
        self._settled = 0
        self._active = 0
        self._closing = False
        self._started = False
        self._finished = False
        self._stale = False
        self._refuse_existing()

    def _refuse_existing(self) -> None:
        existing = [
            p.name
            for p in (self.paths.materialized_inputs, self.paths.successes, self.paths.failures)
            if _non_empty(p)
        ]
        if existing:
            raise UsageError(
                f"record_shard={self.shard!r}: {self.paths.run_dir} already holds that shard "
                f"({', '.join(existing)}); record into a new shard label or folder, or resume the shard "
                "with `gym-ray run` on its materialized inputs"
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
        return copies

    def start(self, rows: list[Row], *, config_identity: str | None) -> None:
        """Open the shard's writer, write ``rows`` as its materialized inputs, then its manifest.

        Called once, with the validated copies, before the first row is admitted.

        Raises:
            UsageError: The shard was recorded meanwhile (another process); nothing is replaced.
            ShardLockError, ShardIOError: As raised by the writer.
        """
        if self._started:
            raise UsageError(f"shard {self.shard!r}: rows are recorded once per call; start() ran already")
        self._refuse_existing()
        self._writer.config_identity = config_identity
        self._writer.open()
        self._started = True
        try:
            self._writer.write_materialized_inputs(rows)
            self._writer.write_manifest(
                ShardManifest.build(
                    run_id=self.run_id,
                    shard=self.shard,
                    config_identity=config_identity,
                    inputs_path=self.paths.materialized_inputs,
                    max_rollout_attempts=self.max_rollout_attempts,
                )
            )
        except Exception:
            self._stale = True  # no row runs; closing only closes the writer
            raise

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
        if not self._started:
            return
        try:
            if not self._stale:
                self._writer.write_progress()
        finally:
            self._writer.close()

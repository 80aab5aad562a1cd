"""A shard's row counts kept while a shard call records, so finishing a run need not read the shard again.

:func:`gym_ray.run.finalize.finalize_run` needs each shard's rows by state (failed, pending, resumable)
as :func:`gym_ray.plan.resume.plan_resume` counts them from the shard's files. A shard call
(:func:`gym_ray.run.collect.run_shard`) already made that plan when it started (its writer open first, so
no older writer appends after it) and appends every record itself, so :class:`ShardRowTally` carries the
plan forward record by record instead of parsing every line again:

- a row done when the call started stays done: its success keeps it out of every count; a row with a
  terminal failure or as many failure attempts as ``max_rollout_attempts`` stays failed;
- a row the call dispatched starts with the failure attempts the plan counted; a record written to the
  successes file makes it succeeded; one written to the failures sidecar adds an attempt (an omitted row's
  line, ``_ng_no_persist``, adds none) and, when ``_ng_failure_terminal`` is true, ends its retries; a row
  with no record keeps its state.

The tally vouches only for what it saw: a record without an integer identity, whose identity is not one of
the rows the call dispatched, or a second record of one row, makes :meth:`ShardRowTally.rows` None, and
the caller reads the shard again. :func:`rows_of_plan` is that reading's count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.plan.resume import ResumePlan
from gym_ray.record.shard_files import Identity, record_identity
from gym_ray.run.result import ShardRows

__all__ = ["ShardRowTally", "rows_of_plan"]

_SUCCEEDED = 0
_FAILED = 1
_TERMINAL = 2
_IGNORED = 3


def rows_of_plan(plan: ResumePlan) -> ShardRows:
    """A resume plan's rows by state: failed (no success, some failure attempt), pending (no outcome),
    resumable (rows a rerun dispatches)."""
    return ShardRows(
        failed=plan.terminal + plan.maxed_out + plan.retrying,
        pending=plan.pending_count - plan.retrying,
        resumable=plan.pending_count,
    )


class ShardRowTally:
    """Carries one shard's resume plan forward over the records one shard call appends.

    Args:
        plan: The plan the call made after opening the shard's writer.
        pending: The rows the call dispatches (``plan.pending``).
        successes: The shard's successes file (what :meth:`ShardWriter.append` returns for a success).
    """

    def __init__(self, plan: ResumePlan, pending: list[dict[str, Any]], successes: Path) -> None:
        """Note each dispatched row's failure attempts so far; nothing is read from disk."""
        self._plan = plan
        self._successes = successes
        self._start: dict[Identity, int] = {}
        self._outcome: dict[Identity, int] = {}
        self._exact = True
        for row in pending:
            identity = record_identity(row)
            if identity is None or identity in self._start:
                self._exact = False
                continue
            self._start[identity] = plan.attempts.get(identity, 0)

    def add(self, record: dict[str, Any], written: Path | None) -> None:
        """Count one record the call appended (``written``: the file it went to, None when not written)."""
        if written is None or not self._exact:
            return
        identity = record_identity(record)
        if identity is None or identity not in self._start or identity in self._outcome:
            self._exact = False
            return
        if written == self._successes:
            self._outcome[identity] = _SUCCEEDED
        elif record.get(keys.NO_PERSIST):
            self._outcome[identity] = _IGNORED
        elif record.get(keys.FAILURE_TERMINAL) is True:
            self._outcome[identity] = _TERMINAL
        else:
            self._outcome[identity] = _FAILED

    def rows(self) -> ShardRows | None:
        """The shard's rows by state after the records added, or None when the tally cannot vouch for them."""
        if not self._exact:
            return None
        plan = self._plan
        cap = plan.max_rollout_attempts
        failed = plan.terminal + plan.maxed_out  # done and not succeeded when the call started
        pending = resumable = 0
        outcome = self._outcome
        for identity, attempts in self._start.items():
            state = outcome.get(identity, _IGNORED)
            if state == _SUCCEEDED:
                continue
            if state != _IGNORED:
                attempts += 1
            if attempts:
                failed += 1
            else:
                pending += 1
            if state != _TERMINAL and attempts < cap:
                resumable += 1
        return ShardRows(failed=failed, pending=pending, resumable=resumable)

"""Resume planning: which rows of a shard still have to run (PROTOCOL.md section 5, "Resume key").

The key is ``(_ng_task_index, _ng_rollout_index)``. A key is *done* when the shard's successes file has
it, or its failures sidecar has a terminal failure for it (``_ng_failure_terminal`` true), or as many
failure attempts as ``max_rollout_attempts``. Every other materialized row is *pending* and runs again
with an ``_ng_attempt_index`` never used for it before: one above the highest attempt index its failure
records carry or the shard's attempt log (:mod:`gym_ray.record.attempt_log`) announced, and at least
the failure attempts recorded so far (the key is omitted when that is 0). So a rollout whose request
may have reached its server without a recorded result (its owner was stopped, killed or taken over
while it was in flight) is sent with a new attempt index, as a retry after a failure is. A folder
without an attempt log (written before it existed) resumes with the failure attempts so far. Rows
appended with ``_ng_no_persist`` (drained; written only under ``record_omitted_rollouts``) are not
attempts: they are ignored, so a drained row runs again without using up an attempt.

Planning only reads: torn tails and corrupt lines are tolerated (a corrupt line's rollout simply runs
again; the ledger reports the line). Open the shard's :class:`~gym_ray.record.writer.ShardWriter` *before*
planning, so that no older writer can append after the plan is made.

Resume refuses, with :class:`~gym_ray.errors.ResumeError`, a shard whose materialized inputs no longer
match its manifest's digest, whose manifest names another config identity than the current one (when both
are known), whose rows are not numbered 0, 1, ... per task in input order, or whose inputs file is
missing (the message says why and what to do).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError, ResumeError
from gym_ray.record.attempt_log import sent_attempts
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.manifest import ShardManifest, read_manifest
from gym_ray.record.shard_files import Identity, file_sha256, list_shards, record_identity, shard_paths

__all__ = ["ResumePlan", "plan_resume", "verify_recorded_inputs"]


@dataclass(frozen=True)
class ResumePlan:
    """What resuming one shard runs, and why the rest is done.

    Attributes:
        shard: The shard label.
        inputs_path: The materialized inputs file the pending rows are read from.
        max_rollout_attempts: The attempt cap applied.
        num_rows: Rows in the materialized inputs.
        succeeded: Rows done by a success.
        terminal: Rows done by a terminal failure (and no success).
        maxed_out: Rows done by reaching the attempt cap (no success, no terminal failure).
        pending_count: Rows that run again.
        retrying: Pending rows that already have failure attempts.
        prior_failure_attempts: Failure lines counted against materialized rows.
        corrupt_lines: Unreadable lines skipped in the successes and failures files.
        ignored_lines: Readable lines that count for nothing: omitted rows, lines without identity, or
            identities not in the materialized inputs.
        attempts: Failure attempts so far per identity (only identities with at least one); the cap
            counts these.
        next_attempts: The attempt index each pending row runs with, where it is not 0: above every
            index recorded or announced for it.
        done: Identities that do not run again.
        manifest: The shard's manifest, if it has one.
    """

    shard: str
    inputs_path: Path
    max_rollout_attempts: int
    num_rows: int
    succeeded: int
    terminal: int
    maxed_out: int
    pending_count: int
    retrying: int
    prior_failure_attempts: int
    corrupt_lines: int
    ignored_lines: int
    attempts: Mapping[Identity, int]
    next_attempts: Mapping[Identity, int]
    done: frozenset[Identity]
    manifest: ShardManifest | None
    _inputs_stamp: tuple[int, int]

    @property
    def done_count(self) -> int:
        """Rows that do not run again."""
        return len(self.done)

    def counts(self) -> dict[str, int]:
        """The plan's counts by outcome, for logs and ``status``."""
        return {
            "num_rows": self.num_rows,
            "succeeded": self.succeeded,
            "terminal": self.terminal,
            "maxed_out": self.maxed_out,
            "pending": self.pending_count,
            "retrying": self.retrying,
            "prior_failure_attempts": self.prior_failure_attempts,
            "corrupt_lines": self.corrupt_lines,
            "ignored_lines": self.ignored_lines,
        }

    @property
    def pending(self) -> list[dict[str, Any]]:
        """The pending rows as a list, read anew on each access (a shard's size bounds it).

        Prefer :meth:`iter_pending` where a stream will do.
        """
        return list(self.iter_pending())

    def iter_pending(self) -> Iterator[dict[str, Any]]:
        """Yield a copy of each pending row, in input order, with its ``_ng_attempt_index`` set.

        The inputs file is read again, lazily (memory does not grow with the rows yielded).

        Raises:
            ResumeError: The inputs file changed since the plan was made.
        """
        if _stamp(self.inputs_path) != self._inputs_stamp:
            raise ResumeError(
                f"shard {self.shard!r}: {self.inputs_path} changed after the resume plan was made; "
                "plan the resume again"
            )
        for _, row in JsonlReader(self.inputs_path, strict=True):
            identity = record_identity(row)
            if identity is None or identity in self.done:
                continue
            pending = dict(row)
            attempt = self.next_attempts.get(identity, 0)
            if attempt:
                pending[keys.ATTEMPT_INDEX] = attempt
            else:
                pending.pop(keys.ATTEMPT_INDEX, None)
            yield pending


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns)


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def plan_resume(
    run_dir: str | os.PathLike[str],
    shard: str,
    *,
    max_rollout_attempts: int = 3,
    config_identity: str | None = None,
    require_config_identity: bool = False,
) -> ResumePlan:
    """Plan the resume of one shard from its files.

    Args:
        run_dir: The run folder.
        shard: The shard label.
        max_rollout_attempts: Failure attempts after which a key is done (>= 1).
        config_identity: The current config's identity digest; checked against the manifest's when both
            are known. A manifest without one verifies its inputs only.
        require_config_identity: Refuse a shard whose manifest records no config identity (or that has no
            manifest), instead of verifying its inputs only.

    Returns:
        The plan. ``plan.iter_pending()`` yields the rows to run.

    Raises:
        ConfigError: ``max_rollout_attempts`` is not an int >= 1.
        ResumeError: The shard cannot be resumed with these inputs or this config (the message says why
            and what to do).

    Example:
        >>> plan = plan_resume(run_dir, "shard-0000", config_identity=identity)  # doctest: +SKIP
        >>> for row in plan.iter_pending():  # doctest: +SKIP
        ...     dispatch(row)
    """
    if type(max_rollout_attempts) is not int or max_rollout_attempts < 1:
        raise ConfigError(
            f"max_rollout_attempts={max_rollout_attempts!r} must be an integer >= 1 (default 3)",
            key="max_rollout_attempts",
        )
    paths = shard_paths(run_dir, shard)
    inputs = paths.materialized_inputs
    if not inputs.exists():
        if _non_empty(paths.successes) or _non_empty(paths.failures):
            raise ResumeError(
                f"shard {shard!r} has recorded outputs but its materialized inputs {inputs} are missing; "
                "resume needs the exact rows the shard was recorded from. Restore that file, or record the "
                "shard again in a new run folder"
            )
        raise ResumeError(
            f"shard {shard!r} has no materialized inputs at {inputs} and nothing recorded: it was never "
            "started. Write its inputs (ShardWriter.write_materialized_inputs) before planning a resume"
        )
    try:
        manifest = read_manifest(run_dir, shard)
    except InputError as exc:
        raise ResumeError(f"shard {shard!r}: {exc}") from exc
    stamp = _stamp(inputs)
    _check_manifest(shard, inputs, manifest, config_identity, require_config_identity)
    planned = _read_inputs(shard, inputs)

    successes: set[Identity] = set()
    attempts: Counter[Identity] = Counter()
    highest_failed: dict[Identity, int] = {}  # the highest attempt index of an identity's failure records
    terminal: set[Identity] = set()
    ignored = 0
    success_reader = JsonlReader(paths.successes)
    for _, record in success_reader:
        identity = record_identity(record)
        if identity is None or identity not in planned:
            ignored += 1
            continue
        successes.add(identity)
    failure_reader = JsonlReader(paths.failures)
    for _, record in failure_reader:
        identity = record_identity(record)
        if identity is None or identity not in planned or record.get(keys.NO_PERSIST):
            ignored += 1
            continue
        attempts[identity] += 1
        index = record.get(keys.ATTEMPT_INDEX)
        index = index if type(index) is int else 0
        if index > highest_failed.get(identity, -1):
            highest_failed[identity] = index
        if record.get(keys.FAILURE_TERMINAL) is True:
            terminal.add(identity)

    maxed = {identity for identity, count in attempts.items() if count >= max_rollout_attempts}
    done = successes | terminal | maxed
    next_attempts = {
        identity: max(count, highest_failed[identity] + 1)
        for identity, count in attempts.items()
        if identity not in done
    }
    for identity, index in sent_attempts(paths.attempt_log, planned).items():
        if identity not in done and index >= next_attempts.get(identity, 0):
            next_attempts[identity] = index + 1
    pending_retrying = sum(1 for identity in attempts if identity not in done)
    return ResumePlan(
        shard=shard,
        inputs_path=inputs,
        max_rollout_attempts=max_rollout_attempts,
        num_rows=len(planned),
        succeeded=len(successes),
        terminal=len(terminal - successes),
        maxed_out=len(maxed - successes - terminal),
        pending_count=len(planned) - len(done),
        retrying=pending_retrying,
        prior_failure_attempts=sum(attempts.values()),
        corrupt_lines=len(success_reader.corrupt_lines) + len(failure_reader.corrupt_lines),
        ignored_lines=ignored,
        attempts=dict(attempts),
        next_attempts=next_attempts,
        done=frozenset(done),
        manifest=manifest,
        _inputs_stamp=stamp,
    )


def verify_recorded_inputs(run_dir: str | os.PathLike[str]) -> int:
    """Check every shard's materialized inputs against the digest its manifest recorded.

    Run before the first dispatch of a resume, so that a damaged or edited inputs file stops the run
    before any row is sent, not when its shard's turn comes. Shards without a manifest or an inputs file
    are left to :func:`plan_resume`.

    Returns:
        The number of shards verified.

    Raises:
        ResumeError: A shard's inputs file does not match its manifest (names the shard, file and digests).
    """
    verified = 0
    for shard in list_shards(run_dir):
        paths = shard_paths(run_dir, shard)
        manifest = read_manifest(run_dir, shard)
        if manifest is None or not paths.materialized_inputs.exists():
            continue
        digest = file_sha256(paths.materialized_inputs)
        if digest != manifest.inputs_digest:
            raise ResumeError(
                f"shard {shard!r}: materialized inputs {paths.materialized_inputs} do not match the manifest "
                f"(sha256 {manifest.inputs_digest[:12]}... recorded, {digest[:12]}... now): the file was "
                "changed or damaged after planning, and nothing was sent. Restore it (for example from the "
                "input file), or pass a new output_dir"
            )
        verified += 1
    return verified


def _check_manifest(
    shard: str,
    inputs: Path,
    manifest: ShardManifest | None,
    config_identity: str | None,
    require_config_identity: bool,
) -> None:
    if manifest is None:
        if require_config_identity:
            raise ResumeError(
                f"shard {shard!r} has no manifest, so nothing proves its results came from the current "
                "config or inputs; record it again in a new run folder, or resume without "
                "require_config_identity to trust the files as they are"
            )
        return
    if manifest.shard != shard:
        raise ResumeError(
            f"shard {shard!r}: its manifest names shard {manifest.shard!r}; the file was copied from "
            "another shard. Restore the right manifest, or remove it to resume without verification"
        )
    digest = file_sha256(inputs)
    if digest != manifest.inputs_digest:
        raise ResumeError(
            f"shard {shard!r}: materialized inputs {inputs} do not match the manifest (sha256 "
            f"{manifest.inputs_digest[:12]}... recorded, {digest[:12]}... now); the rows changed "
            "after the shard was recorded, so its results may belong to other rows. Restore the original "
            "inputs, or record the shard again in a new run folder"
        )
    if manifest.config_identity is None:
        if require_config_identity:
            raise ResumeError(
                f"shard {shard!r} was recorded under a config gym_ray could not identify, so its manifest "
                "verifies its own inputs only and cannot show the current config is the same; resume "
                "without require_config_identity to accept that, or record the shard again"
            )
        return
    if config_identity is not None and config_identity != manifest.config_identity:
        raise ResumeError(
            f"shard {shard!r} was recorded under config identity {manifest.config_identity[:12]}... but the "
            f"current config has {config_identity[:12]}...; resuming would mix results of two configs. "
            "Restore the original config (servers, routing), or record into a new run folder"
        )


def _read_inputs(shard: str, inputs: Path) -> set[Identity]:
    """Identities of the materialized rows, checking that each task's rollouts count up by one in order."""
    planned: set[Identity] = set()
    next_rollout: dict[int, int] = {}
    try:
        for line_no, row in JsonlReader(inputs, strict=True):
            identity = record_identity(row)
            if identity is None:
                raise ResumeError(
                    f"{inputs}:{line_no}: row has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX} (got "
                    f"{row.get(keys.TASK_INDEX)!r}, {row.get(keys.ROLLOUT_INDEX)!r}); shard {shard!r} has "
                    "no rollout identities to resume by. Record it again from preprocessed rows"
                )
            task, rollout = identity
            # A task's first row in a shard may start past 0: identical input lines share a task index,
            # and a later duplicate line can land in a later shard. Within a shard the count is consecutive.
            expected = next_rollout.get(task, rollout)
            if rollout != expected:
                raise ResumeError(
                    f"{inputs}:{line_no}: task {task} has rollout {rollout} where rollout {expected} was "
                    "expected; collection numbers each task's rollouts 0, 1, ... in input order, so these "
                    f"are other materialized inputs than collection writes and shard {shard!r} cannot be "
                    "resumed from them. Preprocess the source rows again into a new run folder"
                )
            next_rollout[task] = expected + 1
            planned.add(identity)
    except InputError as exc:
        raise ResumeError(
            f"shard {shard!r}: {exc}; the inputs file is written atomically, so it was edited or damaged. "
            "Restore it, or record the shard again in a new run folder"
        ) from exc
    return planned

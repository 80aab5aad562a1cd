"""The shard's attempt log: announcements in batches, refused for a stale writer, and what resume makes of it.

Resume runs a pending row with an attempt index above every index recorded (failure records) or
announced (the log) for it; a folder without a log resumes with the failure attempts so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ShardLockError
from gym_ray.plan.resume import plan_resume
from gym_ray.record.attempt_log import Attempt, AttemptAnnouncer, sent_attempts
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter

SHARD = "s0"


def row(task: int, rollout: int = 0, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, **extra}


def fail(task: int, attempt: int = 0) -> dict[str, Any]:
    extra = {keys.ATTEMPT_INDEX: attempt} if attempt else {}
    return row(task, **{keys.FAILURE_CLASS: "agent_run_error"}, **extra)


def writer(run_dir: Path, run_id: str = "run-1") -> ShardWriter:
    return ShardWriter(run_dir, SHARD, run_id=run_id, config_identity=None)


def pending_attempts(run_dir: Path, cap: int = 3) -> list[tuple[int, int]]:
    """``(task, attempt)`` of each row a resume would run, in order."""
    plan = plan_resume(run_dir, SHARD, max_rollout_attempts=cap)
    return [(r[keys.TASK_INDEX], r.get(keys.ATTEMPT_INDEX, 0)) for r in plan.iter_pending()]


def test_resume_sends_announced_rows_above_every_attempt_index_used(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(t) for t in range(5)])
        # epoch 1: tasks 0-3 announced; 1 fails, 2 succeeds, 0 and 3 are in flight when it stops
        w.announce_attempts([(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)])
        w.append(fail(1))
        w.append(row(2, reward=1.0))
    # 0 and 3 may have reached the server at attempt 0; 1's failure used 0; 4 was never announced.
    assert pending_attempts(tmp_path) == [(0, 1), (1, 1), (3, 1), (4, 0)]
    with writer(tmp_path) as w:  # epoch 2: every pending row announced, nothing recorded
        w.announce_attempts([(0, 0, 1), (1, 0, 1), (3, 0, 1), (4, 0, 0)])
    assert pending_attempts(tmp_path) == [(0, 2), (1, 2), (3, 2), (4, 1)]
    # The cap counts failure records, not indices: task 1 has used one of its three attempts.
    plan = plan_resume(tmp_path, SHARD)
    assert (plan.attempts, plan.retrying, plan.pending_count) == ({(1, 0): 1}, 1, 4)
    assert plan.next_attempts == {(0, 0): 2, (1, 0): 2, (3, 0): 2, (4, 0): 1}


def test_a_folder_without_an_attempt_log_resumes_with_the_failures_so_far(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(0), row(1), row(2)])
        w.append(fail(0))
        w.append(fail(0, attempt=1))
        w.append(fail(1))
    assert not shard_paths(tmp_path, SHARD).attempt_log.exists()
    assert pending_attempts(tmp_path) == [(0, 2), (1, 1), (2, 0)]


def test_a_failure_record_with_a_higher_index_than_its_count_is_not_reused(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(0)])
        w.append(fail(0, attempt=4))
    assert pending_attempts(tmp_path) == [(0, 5)]


def test_a_torn_or_garbled_log_line_is_skipped_and_the_next_open_repairs_the_tail(tmp_path: Path) -> None:
    log = shard_paths(tmp_path, SHARD).attempt_log
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(0), row(1), row(2)])
        w.announce_attempts([(0, 0, 0)])
    with log.open("ab") as handle:
        handle.write(b'{"sent":[[1,0,0],[2,0')  # a crash mid-write: never fsynced, so never sent
    assert sent_attempts(log) == {(0, 0): 0}
    assert pending_attempts(tmp_path) == [(0, 1), (1, 0), (2, 0)]
    with writer(tmp_path) as w:
        w.announce_attempts([(1, 0, 0), (0, 0, 1), (7, 0, 3), (1, 0, "x"), (2,)])  # type: ignore[list-item]
    assert log.read_bytes() == (b'{"sent":[[0,0,0]]}\n{"sent":[[1,0,0],[0,0,1],[7,0,3],[1,0,"x"],[2]]}\n')
    # malformed entries are skipped; identities outside the wanted set are left out
    assert sent_attempts(log) == {(0, 0): 1, (1, 0): 0, (7, 0): 3}
    assert sent_attempts(log, {(0, 0), (2, 0)}) == {(0, 0): 1}
    assert pending_attempts(tmp_path) == [(0, 2), (1, 1), (2, 0)]


def test_a_stale_writer_announces_nothing(tmp_path: Path) -> None:
    log = shard_paths(tmp_path, SHARD).attempt_log
    old = writer(tmp_path, "old").open()
    old.write_materialized_inputs([row(0), row(1)])
    old.announce_attempts([(0, 0, 0)])
    new = writer(tmp_path, "new").open()
    before = log.read_bytes()
    with pytest.raises(ShardLockError, match="can no longer announce attempts to it"):
        old.announce_attempts([(1, 0, 0)])
    assert log.read_bytes() == before
    new.announce_attempts([(0, 0, 1), (1, 0, 0)])
    old.close()
    new.close()
    assert sent_attempts(log) == {(0, 0): 1, (1, 0): 0}


def test_the_announcer_announces_each_row_once_in_batches_before_it_is_sent() -> None:
    rows = [row(0), row(1, **{keys.ATTEMPT_INDEX: 2}), row(2), row(3), row(4)]
    lines: list[Sequence[Attempt]] = []
    announce = AttemptAnnouncer(rows, lines.append, batch=2)
    announce(rows[0])
    assert lines == [[(0, 0, 0), (1, 0, 2)]]
    announce(rows[1])  # in the batch already
    announce(rows[0])  # a resend after an infrastructure failure
    assert len(lines) == 1
    announce(rows[3])  # sent before row 2 (row 2 was drained, say): announced through row 3
    announce(rows[2])
    assert lines[1:] == [[(2, 0, 0), (3, 0, 0)]]
    announce(rows[4])
    announce(row(9))  # not one of the call's rows: announced alone
    assert lines[2:] == [[(4, 0, 0)], [(9, 0, 0)]]

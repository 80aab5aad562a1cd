"""Every change the shard writer makes to a shard file happens while it holds the shard lock, as its owner.

The check is made at the moment of each write: the write primitives (``os.write``, ``os.pwrite``,
``os.ftruncate``, ``os.replace``) are wrapped so that, just before one of them touches a shard file, a
second, independent open file description of the lock file tries ``flock(LOCK_EX | LOCK_NB)``. ``flock``
excludes other open file descriptions even in the same process, so the probe fails exactly when the
writer holds the lock. The probe also reads the lock file's token at that moment: a write made after the
lock is released (the ownership token checked under the lock, the write after it) is the window in which
a newer writer can take the shard over and have a stale line land in its file; no interleaving storm has
to hit that window for this test to see it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.record.jsonl import encode_line
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import ShardPaths, shard_paths
from gym_ray.record.writer import ShardWriter

SHARD = "s0"


@dataclass(frozen=True)
class Write:
    """One change to a shard file, seen at the moment it was about to be made."""

    op: str
    name: str
    lock_held: bool
    token: bytes  # the lock file's content at that moment


class WriteProbe:
    """Wraps the write primitives; records every write to a file of the shard (and only those)."""

    def __init__(self, paths: ShardPaths) -> None:
        self.paths = paths
        self.writes: list[Write] = []

    def _is_shard_file(self, path: str) -> bool:
        target = Path(path)
        return target.parent == self.paths.run_dir and target.name.startswith(self.paths.lock.stem)

    def _look(self, op: str, path: str) -> None:
        if not self._is_shard_file(path):
            return
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # EWOULDBLOCK: another open file description holds the lock
                held = True
            else:
                held = False
                fcntl.flock(fd, fcntl.LOCK_UN)
            token = os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
        self.writes.append(Write(op, Path(path).name, held, token))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def by_fd(op: str, real: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(fd: int, *args: Any) -> Any:
                self._look(op, os.readlink(f"/proc/self/fd/{fd}"))
                return real(fd, *args)

            return wrapped

        real_replace = os.replace

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            self._look("replace", os.fspath(dst))
            real_replace(src, dst, **kwargs)

        monkeypatch.setattr(os, "write", by_fd("write", os.write))
        monkeypatch.setattr(os, "pwrite", by_fd("pwrite", os.pwrite))
        monkeypatch.setattr(os, "ftruncate", by_fd("ftruncate", os.ftruncate))
        monkeypatch.setattr(os, "replace", replace)


def _row(task: int, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: 0, **extra}


def _writer(run_dir: Path, **kwargs: Any) -> ShardWriter:
    return ShardWriter(run_dir, SHARD, run_id="run-1", config_identity=None, **kwargs)


def _manifest(run_dir: Path) -> ShardManifest:
    return ShardManifest.build(
        run_id="run-1",
        shard=SHARD,
        config_identity=None,
        inputs_path=shard_paths(run_dir, SHARD).materialized_inputs,
    )


def _damaged_shard(run_dir: Path) -> None:
    """A successes file an earlier writer left with a corrupt middle line and a torn tail."""
    paths = shard_paths(run_dir, SHARD)
    paths.successes.write_bytes(
        encode_line(_row(0)) + b"not json\n" + encode_line(_row(1)) + b'{"_ng_task_index": 2, "_ng_ro'
    )


def _append_all(writer: ShardWriter, count: int) -> ShardWriter:
    for task in range(count):
        writer.append(_row(task))
    return writer


def _with_inputs(writer: ShardWriter) -> ShardWriter:
    writer.write_materialized_inputs([_row(0)])
    return writer


def _taken_over(run_dir: Path) -> ShardWriter:
    """A writer that took the shard over from one that left an unsynced, unindexed line."""
    _writer(run_dir).open().append(_row(9))  # never closed
    return _append_all(_writer(run_dir).open(), 1)


@dataclass(frozen=True)
class Case:
    """One write path: the set-up (before the probe is armed), the action watched, the writes expected."""

    set_up: Callable[[Path], Any]
    act: Callable[[Any, Path], object]
    writes: list[tuple[str, str]]


S, F, LOCK = f"rollouts-{SHARD}.jsonl", f"rollouts-{SHARD}_failures.jsonl", f"rollouts-{SHARD}.lock"
FAILED = {keys.FAILURE_CLASS: "agent_run_error"}
CASES = {
    "open-repairs": Case(
        _damaged_shard,
        lambda w, d: _writer(d).open(),
        [
            ("ftruncate", LOCK),  # the new token, in place
            ("pwrite", LOCK),
            ("ftruncate", S),  # the torn tail
            ("write", f"{S}.quarantine"),  # the corrupt middle line, moved out
            ("replace", S),  # the file rewritten without it
        ],
    ),
    "append": Case(lambda d: _writer(d).open(), lambda w, d: w.append(_row(0)), [("write", S)]),
    "append-failure": Case(
        lambda d: _writer(d).open(), lambda w, d: w.append(_row(0, **FAILED)), [("write", F)]
    ),
    "append-indexed-at-fsync-every": Case(
        lambda d: _append_all(_writer(d, fsync_every=64).open(), 63),
        lambda w, d: w.append(_row(63)),
        [("write", S), ("write", f"{S}.idx")],
    ),
    "checkpoint": Case(
        lambda d: _append_all(_writer(d).open(), 2), lambda w, d: w.checkpoint(), [("write", f"{S}.idx")]
    ),
    "checkpoint-after-takeover": Case(_taken_over, lambda w, d: w.checkpoint(), [("write", f"{S}.idx")]),
    "close": Case(
        lambda d: _append_all(_writer(d).open(), 2), lambda w, d: w.close(), [("write", f"{S}.idx")]
    ),
    "materialized-inputs": Case(
        lambda d: _writer(d).open(),
        lambda w, d: w.write_materialized_inputs([_row(0), _row(1)]),
        [("replace", f"rollouts-{SHARD}_materialized_inputs.jsonl")],
    ),
    "manifest": Case(
        lambda d: _with_inputs(_writer(d).open()),
        lambda w, d: w.write_manifest(_manifest(d)),
        [("replace", f"rollouts-{SHARD}.manifest.json")],
    ),
    "progress": Case(
        lambda d: _writer(d).open(),
        lambda w, d: w.write_progress(),
        [("replace", f"rollouts-{SHARD}.progress.json")],
    ),
    "attempt-log": Case(
        lambda d: _writer(d).open(),
        lambda w, d: w.announce_attempts([(0, 0, 1)]),
        [("write", f"rollouts-{SHARD}.attempts.log")],
    ),
}


@pytest.mark.parametrize("case", [pytest.param(name, id=name) for name in CASES])
def test_every_shard_write_happens_under_the_lock_and_the_writers_own_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    watched = CASES[case]
    probe = WriteProbe(shard_paths(tmp_path, SHARD))
    writer = watched.set_up(tmp_path)
    probe.install(monkeypatch)
    result = watched.act(writer, tmp_path)
    monkeypatch.undo()
    token = probe.paths.lock.read_bytes()  # the watched writer's: nobody opened the shard after it
    assert [(w.op, w.name) for w in probe.writes] == watched.writes
    unlocked = [(w.op, w.name) for w in probe.writes if not w.lock_held]
    assert unlocked == [], f"written while the shard lock was free: {unlocked}"
    # Before its own token is in the lock file, the writer touches nothing but the lock file.
    foreign = [(w.op, w.name) for w in probe.writes if w.token != token and w.name != LOCK]
    assert foreign == [], f"written while the lock file held another writer's token: {foreign}"
    for opened in (writer, result):
        if isinstance(opened, ShardWriter):
            opened.close()

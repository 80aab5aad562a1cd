"""Shard takeover in one process: the last opener holds the shard; a stale writer writes nothing, anywhere."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ShardLockError, UsageError
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import ShardPaths, shard_paths
from gym_ray.record.writer import ShardWriter

SHARD = "s0"


def _row(task: int, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: 0, **extra}


def _writer(run_dir: Path, run_id: str, **kwargs: Any) -> ShardWriter:
    return ShardWriter(run_dir, SHARD, run_id=run_id, config_identity=None, **kwargs)


def _snapshot(paths: ShardPaths) -> dict[str, bytes | None]:
    """Every shard file's bytes (None when absent)."""
    files = (
        paths.successes,
        paths.failures,
        paths.materialized_inputs,
        paths.manifest,
        paths.progress,
        paths.lock,
    )
    return {p.name: (p.read_bytes() if p.exists() else None) for p in files}


def _manifest(run_dir: Path) -> ShardManifest:
    return ShardManifest.build(
        run_id="old",
        shard=SHARD,
        config_identity=None,
        inputs_path=shard_paths(run_dir, SHARD).materialized_inputs,
    )


# Each write path of a writer, called on a writer whose shard another writer opened since.
WRITES: dict[str, Callable[[ShardWriter, Path], object]] = {
    "append": lambda w, d: w.append(_row(9, who="old")),
    "append-failure": lambda w, d: w.append(_row(9, who="old", **{keys.FAILURE_CLASS: "agent_run_error"})),
    "progress": lambda w, d: w.write_progress(),
    "materialized-inputs": lambda w, d: w.write_materialized_inputs([_row(7)]),
    "manifest": lambda w, d: w.write_manifest(_manifest(d)),
    "checkpoint": lambda w, d: w.checkpoint(),
    "close": lambda w, d: w.close(),
}


# What the error says the stale writer can no longer do, per write path.
VERBS = {
    "append": "append to",
    "append-failure": "append to",
    "progress": "write",
    "materialized-inputs": "write the materialized inputs of",
    "manifest": "write",
    "checkpoint": "fsync",
    "close": "fsync",
}


@pytest.mark.parametrize("action", [pytest.param(name, id=name) for name in WRITES])
def test_a_stale_writer_writes_nothing_on_any_path(tmp_path: Path, action: str) -> None:
    paths = shard_paths(tmp_path, SHARD)
    old = _writer(tmp_path, "old").open()
    old.write_materialized_inputs([_row(0), _row(1)])
    old.write_manifest(_manifest(tmp_path))
    old.append(_row(0, who="old"))
    new = _writer(tmp_path, "new").open()
    before = _snapshot(paths)
    with pytest.raises(ShardLockError) as info:
        WRITES[action](old, tmp_path)
    assert _snapshot(paths) == before
    error = info.value
    assert isinstance(error, RuntimeError)
    assert (error.shard, error.holder_pid, error.holder_host) == (SHARD, os.getpid(), socket.gethostname())
    assert str(error) == (
        f"shard '{SHARD}' was opened by another writer since this writer opened it; this writer can no "
        f"longer {VERBS[action]} it (a newer worker owns it: pid {os.getpid()} on {socket.gethostname()}) "
        f"and wrote nothing. Stop this writer; the holder resumes the shard in {tmp_path}"
    )
    # The new holder writes on; the stale writer keeps failing (the same error) until closed, and closing
    # it is quiet.
    new.append(_row(1, who="new"))
    if action != "close":
        with pytest.raises(ShardLockError) as again:
            old.append(_row(2, who="old"))
        assert (str(again.value), again.value.shard, again.value.holder_pid, again.value.holder_host) == (
            str(error),
            SHARD,
            os.getpid(),
            socket.gethostname(),
        )
        old.close()
    with pytest.raises(UsageError, match="closed"):
        old.append(_row(3, who="old"))
    new.close()
    lines = [json.loads(line) for line in paths.successes.read_bytes().splitlines()]
    assert [(r[keys.TASK_INDEX], r["who"]) for r in lines] == [(0, "old"), (1, "new")]
    assert json.loads(paths.lock.read_bytes())["run_id"] == "new"


def test_opening_takes_over_without_waiting_and_keeps_the_lock_file(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, SHARD)
    writers = [_writer(tmp_path, f"w{i}") for i in range(3)]
    inode = None
    for index, writer in enumerate(writers):
        writer.open()
        inode = inode or paths.lock.stat().st_ino
        assert paths.lock.stat().st_ino == inode
        writer.append(_row(index, who=writer.run_id))
        for older in writers[:index]:
            with pytest.raises(ShardLockError):
                older.append(_row(100 + index, who=older.run_id))
    for writer in writers:
        writer.close()
    lines = [json.loads(line) for line in paths.successes.read_bytes().splitlines()]
    assert [r["who"] for r in lines] == ["w0", "w1", "w2"]
    token = json.loads(paths.lock.read_bytes())
    assert (token["run_id"], token["pid"], token["host"]) == ("w2", os.getpid(), socket.gethostname())


def test_a_stale_writer_with_nothing_unsynced_closes_quietly(tmp_path: Path) -> None:
    old = _writer(tmp_path, "old", fsync_every=1000).open()
    old.append(_row(0, who="old"))
    old.checkpoint()
    new = _writer(tmp_path, "new").open()
    old.close()  # nothing left to sync: no write is attempted, so there is nothing to refuse
    with pytest.raises(UsageError, match="closed"):
        old.append(_row(1, who="old"))
    new.close()
    assert new.progress().succeeded == 1


def test_a_writer_taken_over_before_it_wrote_anything_closes_quietly(tmp_path: Path) -> None:
    old = _writer(tmp_path, "old").open()
    new = _writer(tmp_path, "new").open()
    old.close()  # the files it inherited at open are the new holder's to sync; nothing of its own is lost
    new.append(_row(0, who="new"))
    new.close()
    lines = shard_paths(tmp_path, SHARD).successes.read_bytes().splitlines()
    assert [json.loads(line)["who"] for line in lines] == ["new"]


@pytest.mark.parametrize(
    ("token", "holder", "where"),
    [
        pytest.param(b"not json\n", (None, None), "its token is unreadable", id="not-json"),
        pytest.param(b'["pid", 12]\n', (None, None), "its token is unreadable", id="not-an-object"),
        pytest.param(
            b'{"pid": "12", "host": 5}\n', (None, None), "its token is unreadable", id="wrong-types"
        ),
        pytest.param(b'{"pid": 12}\n', (12, None), "pid 12 on None", id="pid-only"),
        pytest.param(b'{"host": "h1"}\n', (None, "h1"), "pid None on h1", id="host-only"),
    ],
)
def test_the_error_names_the_new_holder_as_far_as_its_token_tells(
    tmp_path: Path, token: bytes, holder: tuple[int | None, str | None], where: str
) -> None:
    old = _writer(tmp_path, "old").open()
    shard_paths(tmp_path, SHARD).lock.write_bytes(token)  # another program's token, in place
    with pytest.raises(ShardLockError) as info:
        old.append(_row(0))
    assert (info.value.holder_pid, info.value.holder_host) == holder
    assert f"(a newer worker owns it: {where}) and wrote nothing" in str(info.value)
    old.close()
    assert shard_paths(tmp_path, SHARD).successes.read_bytes() == b""

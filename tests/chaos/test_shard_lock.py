"""Shard ownership across processes (RELIABILITY.md R6, R7): real processes, real flock, real files."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gym_ray.record.shard_files import shard_paths

# A writer process driven line by line over stdin; it answers each command with one line.
WRITER = r"""
import sys, time
from gym_ray.record.writer import ShardWriter
from gym_ray.errors import ShardLockError

run_dir, shard, name = sys.argv[1:4]
writer = ShardWriter(run_dir, shard, run_id=name, config_identity=None)
period = 0  # how many times this process opened the shard: each open is a new writer, a new token
for command in sys.stdin:
    verb, _, arg = command.strip().partition(" ")
    try:
        if verb == "open":
            if period > 0:
                writer = ShardWriter(run_dir, shard, run_id=name, config_identity=None)
            writer.open()
            period += 1
            answer = "ok"
        elif verb == "append":
            writer.append(
                {"_ng_task_index": int(arg), "_ng_rollout_index": 0, "writer": name, "period": period}
            )
            answer = "ok"
        elif verb == "spam":
            # Append as fast as possible until another writer takes the shard (or 20 s pass).
            count, deadline = 0, time.monotonic() + 20
            try:
                while time.monotonic() < deadline:
                    writer.append(
                        {"_ng_task_index": 1000 + count, "_ng_rollout_index": 0, "writer": name,
                         "period": period, "seq": count}
                    )
                    count += 1
                    if count == 50:
                        print("started", flush=True)
                answer = f"timeout {count}"
            except ShardLockError as exc:
                answer = f"stopped {count} {exc.holder_pid}"
        elif verb == "close":
            writer.close()
            answer = "ok"
        else:
            break
    except Exception as exc:
        answer = f"error {type(exc).__name__}: {exc}"
    print(answer, flush=True)
"""

# A process that takes the lock `cycles` times, marking each hold in a side file, after a barrier.
LOCKER = r"""
import os, sys, time
from gym_ray.record.shard_files import ShardLock

lock_path, side_path, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
lock = ShardLock(lock_path)
lock.open()
inode = os.fstat(lock.fd).st_ino
side = os.open(side_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
pid = os.getpid()
print("ready", flush=True)
sys.stdin.readline()
changed = 0
for i in range(cycles):
    with lock.held():
        os.write(side, f"start {pid}\n".encode())
        if os.stat(lock_path).st_ino != inode:
            changed += 1
        if i % 50 == 0:
            lock.write_token(f"{pid} {i}\n".encode())
        time.sleep(0.0002)
        os.write(side, f"end {pid}\n".encode())
lock.close()
print(f"{inode} {changed}", flush=True)
"""


@contextmanager
def spawn(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def ask(proc: subprocess.Popen[str], command: str) -> str:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def writers_of(path: Path) -> list[str]:
    return [json.loads(line)["writer"] for line in path.read_bytes().splitlines()]


def test_second_process_takes_the_shard_and_the_stale_writer_writes_nothing(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    with spawn(WRITER, str(tmp_path), "s0", "A") as a, spawn(WRITER, str(tmp_path), "s0", "B") as b:
        assert ask(a, "open") == "ok"
        inode = paths.lock.stat().st_ino
        assert [ask(a, f"append {i}") for i in range(3)] == ["ok"] * 3
        assert ask(b, "open") == "ok"
        stale = ask(a, "append 3")
        assert stale.startswith(
            "error ShardLockError: shard 's0' was opened by another writer since this writer opened it; "
            "this writer can no longer append to it (a newer worker owns it: pid "
        )
        assert [ask(b, f"append {i}") for i in range(3, 6)] == ["ok"] * 3
        assert ask(a, "append 6").startswith("error ShardLockError")
        assert ask(a, "close") == "ok"
        assert ask(b, "close") == "ok"
    assert writers_of(paths.successes) == ["A", "A", "A", "B", "B", "B"]
    assert paths.lock.stat().st_ino == inode


def test_takeover_during_a_write_storm_never_interleaves(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    with spawn(WRITER, str(tmp_path), "s0", "A") as a, spawn(WRITER, str(tmp_path), "s0", "B") as b:
        assert ask(a, "open") == "ok"
        assert a.stdin is not None
        a.stdin.write("spam\n")
        a.stdin.flush()
        assert read_line(a) == "started"
        assert ask(b, "open") == "ok"
        outcome = read_line(a)
        assert outcome.startswith("stopped ")
        written_by_a = int(outcome.split()[1])
        assert outcome.split()[2] == str(b.pid)
        assert [ask(b, f"append {i}") for i in range(5)] == ["ok"] * 5
        assert ask(a, "close") == "ok"
        assert ask(b, "close") == "ok"
    assert writers_of(paths.successes) == ["A"] * written_by_a + ["B"] * 5


def test_lock_holds_never_overlap_and_the_lock_file_is_never_replaced(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    side = tmp_path / "holds.log"
    procs, cycles = 4, 200
    with (
        spawn(LOCKER, str(paths.lock), str(side), str(cycles)) as p1,
        spawn(LOCKER, str(paths.lock), str(side), str(cycles)) as p2,
        spawn(LOCKER, str(paths.lock), str(side), str(cycles)) as p3,
        spawn(LOCKER, str(paths.lock), str(side), str(cycles)) as p4,
    ):
        group = [p1, p2, p3, p4]
        assert [read_line(p) for p in group] == ["ready"] * procs
        inode = paths.lock.stat().st_ino
        for p in group:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [read_line(p).split() for p in group]
    assert reports == [[str(inode), "0"]] * procs
    assert paths.lock.stat().st_ino == inode
    marks = side.read_text().splitlines()
    assert len(marks) == procs * cycles * 2
    overlaps = 0
    holders = set()
    for start, end in zip(marks[::2], marks[1::2], strict=True):
        kind_start, pid_start = start.split()
        kind_end, pid_end = end.split()
        if (kind_start, kind_end) != ("start", "end") or pid_start != pid_end:
            overlaps += 1
        holders.add(pid_start)
    assert overlaps == 0
    assert len(holders) == procs
    assert os.path.exists(paths.lock)


def _start_spam(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("spam\n")
    proc.stdin.flush()
    assert read_line(proc) == "started"


def test_every_line_belongs_to_exactly_one_writers_token_period(tmp_path: Path) -> None:
    """Three processes take the shard from each other mid-storm, then the first one takes it back."""
    paths = shard_paths(tmp_path, "s0")
    with (
        spawn(WRITER, str(tmp_path), "s0", "A") as a,
        spawn(WRITER, str(tmp_path), "s0", "B") as b,
        spawn(WRITER, str(tmp_path), "s0", "C") as c,
    ):
        stopped: list[tuple[str, int, int, str]] = []  # (writer, period, lines written, holder pid named)
        sequence = [(a, "A", 1), (b, "B", 1), (c, "C", 1)]
        assert ask(a, "open") == "ok"
        _start_spam(a)
        for (older, name, period), (newer, _, _) in itertools.pairwise(sequence):
            assert ask(newer, "open") == "ok"
            verb, count, holder = read_line(older).split()
            assert (verb, holder) == ("stopped", str(newer.pid))
            stopped.append((name, period, int(count), holder))
            _start_spam(newer)
        assert ask(a, "open") == "ok"  # a new writer in process A: period 2
        verb, count, holder = read_line(c).split()
        assert (verb, holder) == ("stopped", str(a.pid))
        stopped.append(("C", 1, int(count), holder))
        assert [ask(a, f"append {i}") for i in range(5)] == ["ok"] * 5
        for proc in (a, b, c):
            assert ask(proc, "close") == "ok"
        token = json.loads(paths.lock.read_bytes())
        assert (token["pid"], token["run_id"]) == (a.pid, "A")
    records = [json.loads(line) for line in paths.successes.read_bytes().splitlines()]
    # The file is the token periods one after the other: each period's lines, contiguous and complete.
    periods = [(r["writer"], r["period"]) for r in records]
    expected = [(name, period) for name, period, count, _ in stopped for _ in range(count)] + [("A", 2)] * 5
    assert periods == expected
    for name, period, count, _ in stopped:
        seqs = [r["seq"] for r in records if (r["writer"], r["period"]) == (name, period)]
        assert seqs == list(range(count))

"""The merge's fast ways against its per-entry way: a shard read into packed integer keys and kept
(``_read_packed`` / ``_keep_packed``) writes the bytes and counts ``read_shard`` + ``keep_lines`` write; the
kept files are appended in the kernel or through a buffer alike; this process shares the shards with the
pool and errors still surface in shard order."""

from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import InputError
from gym_ray.finalize import merge, merge_ahead
from gym_ray.finalize._merge_shard import (
    Tally,
    _keep_packed,
    _read_packed,
    keep_lines,
    read_shard,
    reduce_shard,
)
from tests.finalize.test_merge import _mutations, fail, rec, write_lines

_WAIT_S = 60.0


def _slow_way(base: Path, shard: str) -> tuple[bytes, bytes, dict[str, int], Any]:
    """The per-entry way: what the merge did before the packed way, and still does for other shards."""
    lines = read_shard(base, shard)
    out_ok, out_failed, tally = io.BytesIO(), io.BytesIO(), Tally()
    keep_lines(lines.entries, out_ok, out_failed, tally)
    tally.corrupt, tally.omitted = lines.corrupt, lines.omitted
    entries = lines.entries
    span = ((entries[0][0], entries[0][1]), (entries[-1][0], entries[-1][1])) if entries else None
    return out_ok.getvalue(), out_failed.getvalue(), vars(tally), span


def _packed_way(base: Path, shard: str, tmp: Path) -> tuple[bytes, bytes, dict[str, int], Any]:
    packed = _read_packed(base, shard)
    assert packed is not None
    reduced = _keep_packed(packed, tmp / "ok", tmp / "failed")
    return reduced.successes.read_bytes(), reduced.failures.read_bytes(), vars(reduced.tally), reduced.span


def _line(record: dict[str, Any], rng: random.Random) -> bytes:
    spaced = rng.random() < 0.1
    text = json.dumps(record, ensure_ascii=rng.random() < 0.5, separators=None if spaced else (",", ":"))
    return text.encode()


def _random_shard(rng: random.Random, base: Path, shard: str) -> None:
    """Successes and failures of a few identities (so many repeat), with everything a shard may hold."""
    files: dict[str, list[bytes]] = {"": [], "_failures": []}
    mutated = iter(_mutations(seed=rng.randrange(1000), count=40))
    for line_no in range(rng.randrange(0, 60)):
        task = rng.choice([0, 1, 2, 7, -3, 2**63 - 1, -(2**63)])
        rollout, attempt = rng.randrange(3), rng.choice([0, 0, 1, 2, 2**63 - 1, -1])
        payload: dict[str, Any] = {
            "src": f"{shard}:{line_no}",
            "text": rng.choice(["plain", "caf\u00e9 \u2603 \U0001f600", 'quote " and \\ slash']),
            "big": rng.choice([2**70, -(10**30), 0]),
            "float": rng.choice([0.1, 1e-7, -0.0, 1e300, 12345678.9]),
        }
        kind = rng.random()
        if kind < 0.45:
            extra = {keys.NO_PERSIST: True} if rng.random() < 0.1 else {}  # in the successes file: kept
            files[""].append(_line(rec(task, rollout, attempt, **payload, **extra), rng))
        elif kind < 0.85:
            extra = {}
            if rng.random() < 0.3:
                extra[keys.FAILURE_TERMINAL] = rng.choice([True, True, 1, "true"])  # only True is terminal
            if rng.random() < 0.15:
                extra[keys.NO_PERSIST] = rng.choice([True, 1, 0, None])  # truthy: an omitted row
            files["_failures"].append(_line(fail(task, rollout, attempt, **payload, **extra), rng))
        elif kind < 0.92:
            files[rng.choice(["", "_failures"])].append(next(mutated))  # a corrupt line, or a record
        elif kind < 0.96:
            files[rng.choice(["", "_failures"])].append(rng.choice([b"", b"  \t", b"\r"]))  # blank
        else:
            # an attempt index that is not an int counts as attempt 0
            odd_attempt = rng.choice([1.0, True, "2", None, [1]])
            record = rec(task, rollout, **payload)
            record[keys.ATTEMPT_INDEX] = odd_attempt
            files[rng.choice(["", "_failures"])].append(_line(record, rng))
    for suffix, lines in files.items():
        if not lines and rng.random() < 0.5:
            continue  # a missing file has no lines
        data = b"".join(line + b"\n" for line in lines)
        if lines and rng.random() < 0.3:
            data = data[: -rng.randrange(1, min(len(data), 40) + 1)]  # a torn tail (or a lost newline)
        write_lines(base, f"rollouts-{shard}{suffix}.jsonl", [data])


@pytest.mark.parametrize("seed", range(40))
def test_packed_way_keeps_what_the_per_entry_way_keeps(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    _random_shard(rng, tmp_path, "a")
    try:
        expected: Any = _slow_way(tmp_path, "a")
    except InputError as exc:  # a mutated line kept the JSON but lost an integer identity
        expected = (str(exc), exc.path, exc.line)
    try:
        got: Any = _packed_way(tmp_path, "a", tmp_path)
    except InputError as exc:
        got = (str(exc), exc.path, exc.line)
    assert got == expected


def test_the_random_shards_hold_every_case_the_rules_tell_apart(tmp_path: Path) -> None:
    """The seeds above are not vacuous: summed, every count of the merge is exercised."""
    totals: dict[str, int] = {}
    for seed in range(40):
        run_dir = tmp_path / str(seed)
        run_dir.mkdir()
        _random_shard(random.Random(seed), run_dir, "a")
        try:
            counts = _slow_way(run_dir, "a")[2]
        except InputError:
            continue
        for name, value in counts.items():
            totals[name] = totals.get(name, 0) + value
    assert all(value > 0 for value in totals.values()), totals


@pytest.mark.parametrize(
    ("records", "packed"),
    [
        pytest.param(
            [rec(-(2**63), 2**63 - 1, 2**63 - 1), fail(2**63 - 1, -(2**63))], True, id="int64-edges"
        ),
        pytest.param([rec(2**63, 0), rec(0, 0)], False, id="task-past-int64"),
        pytest.param([rec(0, -(2**63) - 1), rec(0, 0)], False, id="rollout-below-int64"),
        pytest.param([fail(0, 0, 2**64), fail(0, 0, 1)], False, id="attempt-past-int64"),
    ],
)
def test_indices_outside_int64_take_the_per_entry_way(
    tmp_path: Path, records: list[dict[str, Any]], packed: bool
) -> None:
    successes = [json.dumps(r).encode() + b"\n" for r in records if "_ng_failure_class" not in r]
    failures = [json.dumps(r).encode() + b"\n" for r in records if "_ng_failure_class" in r]
    write_lines(tmp_path, "rollouts-a.jsonl", successes)
    write_lines(tmp_path, "rollouts-a_failures.jsonl", failures)
    assert (_read_packed(tmp_path, "a") is not None) == packed
    expected = _slow_way(tmp_path, "a")
    reduced = reduce_shard(tmp_path, "a", 0, tmp_path)
    got = reduced.successes.read_bytes(), reduced.failures.read_bytes(), vars(reduced.tally), reduced.span
    assert got == expected


def _copy_case(tmp_path: Path) -> tuple[list[Path], bytes]:
    rng = random.Random(5)
    parts = []
    for number, size in enumerate([0, 1, 70_000, 3 << 20]):
        path = tmp_path / f"part-{number}"
        path.write_bytes(rng.randbytes(size))
        parts.append(path)
    return parts, b"".join(p.read_bytes() for p in parts)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("kernel", id="copy_file_range"),
        pytest.param("none", id="no-copy_file_range"),
        pytest.param("refused", id="refused-at-once"),
        pytest.param("refused-midway", id="refused-after-a-part"),
    ],
)
def test_kept_files_are_appended_alike_in_the_kernel_or_through_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    parts, expected = _copy_case(tmp_path)
    real = getattr(os, "copy_file_range", None)
    if mode == "none":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    elif mode.startswith("refused"):
        calls = []

        def refuse(src: int, dst: int, count: int) -> int:
            calls.append(count)
            if mode == "refused-midway" and len(calls) == 1 and real is not None:
                return real(src, dst, 1000)  # part of the file, then the file system refuses
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    out_path = tmp_path / "out"
    with out_path.open("wb") as out:
        out.write(b"head:")  # buffered bytes written before the appended files must come first
        for part in parts:
            merge_ahead.append_file(part, out)
        out.write(b":end")
    assert out_path.read_bytes() == b"head:" + expected + b":end"


def test_other_copy_errors_are_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(src: int, dst: int, count: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", no_space, raising=False)
    (tmp_path / "part").write_bytes(b"x\n")
    with (tmp_path / "out").open("wb") as out, pytest.raises(OSError, match="No space"):
        merge_ahead.append_file(tmp_path / "part", out)


def test_this_process_takes_shards_from_the_back_while_the_pool_works(tmp_path: Path) -> None:
    """A pool whose one process is busy with shard 0 leaves every other shard to this thread, in order."""
    shards = [f"s{n}" for n in range(6)]
    ran_by: dict[int, str] = {}
    zero_started, others_done = threading.Event(), threading.Event()

    def job(base: Path, shard: str, number: int, tmp: Path) -> str:
        if number == 0:  # the pool's one thread takes shard 0 first and holds it until 1-5 are done
            zero_started.set()
            assert others_done.wait(_WAIT_S)
        if number == 5:  # the first shard this thread takes back: by then the pool is busy with shard 0
            assert zero_started.wait(_WAIT_S)
        ran_by[number] = threading.current_thread().name
        if number == 1:
            others_done.set()
        return shard.upper()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
        results = merge._each_shard(job, tmp_path, shards, tmp_path, pool)
    assert results == ["S0", "S1", "S2", "S3", "S4", "S5"]
    here = threading.current_thread().name
    assert ran_by == {0: "pool_0", **{n: here for n in range(1, 6)}}


def test_the_first_failing_shard_in_shard_order_raises_when_this_process_fails_a_later_one(
    tmp_path: Path,
) -> None:
    """This process fails shard 4 first; shard 2, left to the pool, fails too: shard 2's error is raised."""
    shards = [f"s{n}" for n in range(5)]
    later_failed = threading.Event()
    ran: list[int] = []

    def job(base: Path, shard: str, number: int, tmp: Path) -> str:
        if number == 0:
            assert later_failed.wait(_WAIT_S)
        ran.append(number)
        if number == 4:
            later_failed.set()
            raise InputError(f"{shard} is bad", path=shard, line=1)
        if number == 2:
            raise InputError(f"{shard} is bad", path=shard, line=1)
        return shard

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        pytest.raises(InputError, match=r"^s2 is bad$"),
    ):
        merge._each_shard(job, tmp_path, shards, tmp_path, pool)
    assert {0, 1, 2, 4} <= set(ran)  # 3 is cancelled unless the pool had started it

"""The shard writer's line index: a merge that keys lines from it writes exactly the bytes and counts of a
merge that parses every line, whatever the index holds (missing, stale, torn, lying, corrupted)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import InputError
from gym_ray.finalize.merge import merge_shards
from gym_ray.record import line_index
from gym_ray.record.line_index import index_blocks, index_path
from gym_ray.record.shard_files import list_shards, shard_paths
from gym_ray.record.writer import ShardWriter
from tests.finalize.test_merge import fail, rec

_HEADER = struct.Struct("<4sQQII")


def _merged(run_dir: Path, into: Path) -> Any:
    """Copy ``run_dir`` to ``into`` and merge the copy in this process: output bytes and counts, or the
    error."""
    shutil.copytree(run_dir, into)
    try:
        result = merge_shards(into, workers=1)
    except InputError as exc:
        return ("InputError", str(exc).replace(str(into), "<dir>"), exc.line)
    counts = result.model_dump(exclude={"successes_path", "failures_path"})
    return result.successes_path.read_bytes(), result.failures_path.read_bytes(), counts


def _without_index(run_dir: Path, into: Path) -> Any:
    """The merge of ``run_dir`` with every index removed: every line parsed, as before the index."""
    shutil.copytree(run_dir, into)
    for name in os.listdir(into):
        if name.endswith(line_index.INDEX_SUFFIX):
            os.unlink(into / name)
    return _merged(into, into.with_name(into.name + "-merged"))


def _assert_same_as_parsing(run_dir: Path, tmp: Path) -> Any:
    got = _merged(run_dir, tmp / "with-index")
    assert got == _without_index(run_dir, tmp / "no-index")
    return got


def _covered(path: Path) -> int:
    """Lines of ``path`` keyed from a verified index batch."""
    return sum(len(block.lines) for block in index_blocks(path) if block.lines is not None)


def _write(run_dir: Path, shard: str, records: list[dict[str, Any]], *, batch: int = 3) -> None:
    """Append ``records`` through the writer, with a checkpoint (an index batch) every ``batch`` records."""
    with ShardWriter(
        run_dir, shard, run_id="r", config_identity=None, record_omitted_rollouts=True
    ) as writer:
        for number, record in enumerate(records, start=1):
            writer.append(record)
            if number % batch == 0:
                writer.checkpoint()


def _varied(rng: random.Random, label: str, tasks: list[int]) -> list[dict[str, Any]]:
    """Successes and failures of a few identities, with everything the merge rules tell apart."""
    records: list[dict[str, Any]] = []
    for n in range(rng.randrange(5, 40)):
        task, rollout, attempt = rng.choice(tasks), rng.randrange(3), rng.choice([0, 0, 1, 2, 2**63 - 1])
        payload = {
            "src": f"{label}:{n}",
            "text": rng.choice(["plain", "caf\u00e9 \u2603 \U0001f600", 'quote " \\ and\nnewline']),
            "big": rng.choice([2**70, -(10**30), 0, 1e-7]),
        }
        roll = rng.random()
        if roll < 0.4:
            records.append(rec(task, rollout, attempt, **payload))
        elif roll < 0.85:
            extra: dict[str, Any] = {}
            if rng.random() < 0.3:
                extra[keys.FAILURE_TERMINAL] = rng.choice([True, 1, "true"])  # only true is terminal
            records.append(fail(task, rollout, attempt, **payload, **extra))
        elif roll < 0.92:
            # an omitted row: a failure-file line the merge leaves out (truthy) or keeps (falsy)
            records.append(
                fail(task, rollout, attempt, **{keys.NO_PERSIST: rng.choice([True, 1, "x", 0, None])})
            )
        else:
            # indices no index entry can hold: left to parsing, in the middle of a batch
            odd = rng.choice([2**64, -(2**63) - 1, True, 1.0])
            record = rec(task, rollout, **payload)
            record[rng.choice([keys.ATTEMPT_INDEX, keys.ROLLOUT_INDEX, keys.TASK_INDEX])] = odd
            if type(record[keys.TASK_INDEX]) is int and type(record[keys.ROLLOUT_INDEX]) is int:
                records.append(record)
    return records


@pytest.mark.parametrize("seed", range(12))
def test_the_index_changes_no_byte_and_no_count(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    shared = rng.random() < 0.5  # shards sharing identities take the merge's general way
    for number in range(3):
        tasks = [0, 1, 2, -5, 2**63 - 1] if shared else [10 * number + t for t in range(3)]
        _write(run_dir, f"s{number}", _varied(rng, f"s{number}", tasks), batch=rng.choice([1, 3, 256]))
    _assert_same_as_parsing(run_dir, tmp_path)
    assert sum(_covered(shard_paths(run_dir, f"s{n}").successes) for n in range(3)) > 0


def test_every_line_of_a_plain_shard_is_keyed_from_the_index(tmp_path: Path) -> None:
    records = [rec(t, r, text="\u00e9") for t in (3, 1, 2) for r in (1, 0)] + [rec(1, 0, 1)]
    records += [
        fail(9, 0, 0),
        fail(9, 0, 1, **{keys.FAILURE_TERMINAL: True}),
        fail(8, 0, 0, _ng_no_persist=True),
    ]
    _write(tmp_path / "run", "a", records)
    paths = shard_paths(tmp_path / "run", "a")
    assert (_covered(paths.successes), _covered(paths.failures)) == (7, 3)
    *_, counts = _assert_same_as_parsing(tmp_path / "run", tmp_path)
    assert (counts["successes"], counts["duplicate_successes_dropped"]) == (6, 1)
    assert (counts["failures"], counts["terminal_failures"], counts["omitted_rows_skipped"]) == (2, 1, 1)


def test_the_index_files_are_no_shard_files(tmp_path: Path) -> None:
    _write(tmp_path, "a", [rec(0, 0), fail(1, 0)])
    assert index_path(shard_paths(tmp_path, "a").successes).exists()
    assert index_path(shard_paths(tmp_path, "a").failures).exists()
    assert list_shards(tmp_path) == ["a"]


def _batches(path: Path) -> list[tuple[int, int, bytes]]:
    """``(start, end, bytes)`` of each batch in the index of ``path``."""
    index = index_path(path).read_bytes()
    out, pos = [], 0
    while pos < len(index):
        lines = _HEADER.unpack_from(index, pos)[3]
        end = pos + _HEADER.size + lines * 33
        out.append((pos, end, index[pos:end]))
        pos = end
    return out


def _forge(batch: bytes, data: bytes, **fields: int) -> bytes:
    """``batch`` with header fields replaced and its CRC made to match ``data`` at its (new) range."""
    magic, offset, length, lines, _ = _HEADER.unpack_from(batch)
    offset, length, lines = (
        fields.get("offset", offset),
        fields.get("length", length),
        fields.get("lines", lines),
    )
    columns = batch[_HEADER.size :]
    if lines != _HEADER.unpack_from(batch)[3]:  # fewer lines: the columns of the first ones
        old = _HEADER.unpack_from(batch)[3]
        columns = columns[: 32 * lines] + columns[32 * old : 32 * old + lines]
    head = _HEADER.pack(magic, offset, length, lines, 0)[:-4]
    crc = zlib.crc32(columns, zlib.crc32(head, zlib.crc32(data[offset : offset + length])))
    return head + crc.to_bytes(4, "little") + columns


def _lying_cases() -> list[str]:
    return [
        "flipped-crc",
        "flipped-key",
        "offsets-shifted",
        "forged-offsets",
        "forged-line-count",
        "truncated-index",
        "garbage-appended",
        "batch-repeated",
        "past-data-end",
        "data-edited",
        "index-of-another-file",
    ]


@pytest.mark.parametrize("case", _lying_cases())
def test_an_index_that_lies_gives_the_result_of_parsing(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    records = [rec(t, r, note="n" * t) for t in range(6, 0, -1) for r in range(2)] + [fail(20, 0, 1)]
    _write(run_dir, "a", records, batch=4)
    path = shard_paths(run_dir, "a").successes
    data = path.read_bytes()
    index = index_path(path).read_bytes()
    batches = _batches(path)
    assert len(batches) == 3
    second_start, second_end, second = batches[1]
    if case == "flipped-crc":
        index = (
            index[: second_start + 24] + bytes([index[second_start + 24] ^ 1]) + index[second_start + 25 :]
        )
    elif case == "flipped-key":  # a task index one off: the CRC no longer matches
        at = second_start + _HEADER.size + 32 + 7
        index = index[:at] + bytes([index[at] ^ 1]) + index[at + 1 :]
    elif case == "offsets-shifted":
        magic, offset, length, lines, crc = _HEADER.unpack_from(second)
        index = (
            index[:second_start]
            + _HEADER.pack(magic, offset + 1, length, lines, crc)
            + index[second_start + 28 :]
        )
    elif case == "forged-offsets":  # a matching CRC for a range that does not start at a line
        index = index[:second_start] + _forge(second, data, offset=_HEADER.unpack_from(second)[1] + 3)
        index += b"".join(b for _, _, b in batches[2:])
    elif case == "forged-line-count":  # a matching CRC, one line fewer than the range holds
        index = index[:second_start] + _forge(second, data, lines=3) + index[second_end:]
    elif case == "truncated-index":
        index = index[: second_start + 40]
    elif case == "garbage-appended":
        index += bytes(random.Random(1).randrange(256) for _ in range(200))
    elif case == "batch-repeated":
        index = index[:second_end] + second + index[second_end:]
    elif case == "past-data-end":  # the data lost its last lines (a power loss before an fsync)
        path.write_bytes(data[: _HEADER.unpack_from(batches[2][2])[1] + 5])
    elif case == "data-edited":  # a line edited in place, same length
        at = _HEADER.unpack_from(second)[1] + 30
        path.write_bytes(data[:at] + b"X" + data[at + 1 :])
    elif case == "index-of-another-file":
        index = index_path(shard_paths(run_dir, "a").failures).read_bytes()
    index_path(path).write_bytes(index)
    _assert_same_as_parsing(run_dir, tmp_path)
    if case in (
        "flipped-crc",
        "flipped-key",
        "offsets-shifted",
        "forged-offsets",
        "forged-line-count",
        "data-edited",
    ):
        assert _covered(path) == 4  # the first batch still serves; from the lie on, lines are parsed


def test_a_torn_tail_repaired_by_the_next_writer_keeps_only_batches_it_can_verify(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write(run_dir, "a", [rec(t, 0) for t in range(10)], batch=4)
    path = shard_paths(run_dir, "a").successes
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])  # the last line torn (a power loss)
    _write(run_dir, "a", [rec(t, 1) for t in range(10, 13)])  # opens: repairs the tail, trims the index
    assert [len(block.lines) if block.lines else None for block in index_blocks(path)] == [4, 4, None, 3]
    _assert_same_as_parsing(run_dir, tmp_path)


def test_a_quarantine_rewrite_empties_the_index_and_a_stale_one_is_verified_not_trusted(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    _write(run_dir, "a", [rec(t, 0) for t in range(8)], batch=2)
    path = shard_paths(run_dir, "a").successes
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + b"{not json\n" + b"".join(lines[3:]))
    stale = index_path(path).read_bytes()
    _write(run_dir, "a", [rec(9, 0)])  # opens: quarantines the corrupt line, rewriting the file
    assert (run_dir / "rollouts-a.jsonl.quarantine").exists()
    assert [len(block.lines) if block.lines else None for block in index_blocks(path)] == [None, 1]
    _assert_same_as_parsing(run_dir, tmp_path / "fresh")
    index_path(path).write_bytes(stale + index_path(path).read_bytes())  # as an older gym_ray might leave it
    _assert_same_as_parsing(run_dir, tmp_path / "stale")


def test_an_index_batch_is_written_at_checkpoints_after_its_lines(tmp_path: Path) -> None:
    """A batch is written at each checkpoint and on close, never before the lines it covers."""
    writer = ShardWriter(tmp_path, "a", run_id="r", config_identity=None, fsync_every=1000)
    writer.open()
    path = shard_paths(tmp_path, "a").successes
    writer.append(rec(1, 0))
    writer.append(rec(0, 0))
    assert index_path(path).read_bytes() == b""  # lines on disk, their batch pending
    writer.checkpoint()
    assert _covered(path) == 2
    writer.append(rec(2, 0))
    writer.close()
    assert _covered(path) == 3


@pytest.mark.parametrize("seed", range(30))
def test_random_corruption_of_data_and_index_gives_the_result_of_parsing(tmp_path: Path, seed: int) -> None:
    rng = random.Random(1000 + seed)
    run_dir = tmp_path / "run"
    for number in range(2):
        records = _varied(rng, f"s{number}", [10 * number + t for t in range(4)])
        _write(run_dir, f"s{number}", records, batch=rng.choice([1, 2, 5]))
    names = sorted(os.listdir(run_dir))
    targets = [n for n in names if n.endswith((".jsonl", ".idx")) and (run_dir / n).stat().st_size]
    for _ in range(rng.randrange(1, 6)):
        target = run_dir / rng.choice(targets)
        blob = bytearray(target.read_bytes())
        if not blob:
            continue
        action = rng.random()
        at = rng.randrange(len(blob))
        if action < 0.6:
            blob[at] ^= 1 << rng.randrange(8)
        elif action < 0.8:
            del blob[at:]
        else:
            blob[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        target.write_bytes(bytes(blob))
    _assert_same_as_parsing(run_dir, tmp_path)


def test_with_a_small_fsync_every_the_index_is_written_every_64_records(tmp_path: Path) -> None:
    """Syncs that ``fsync_every`` triggers write a file's batch once it holds 64 lines (not one index write
    and fsync per record); close writes the rest."""
    writer = ShardWriter(tmp_path, "a", run_id="r", config_identity=None, fsync_every=1)
    writer.open()
    path = shard_paths(tmp_path, "a").successes
    for task in range(63):
        writer.append(rec(task, 0))
    assert index_path(path).read_bytes() == b""
    writer.append(rec(63, 0))
    assert _covered(path) == 64
    writer.append(rec(64, 0))
    writer.close()
    assert _covered(path) == 65

"""A shard's file names, label rules, discovery, record identity, file digest and lock file, on real files.

Expected names and messages are written out by hand from the module's documented contract; the digest is
checked against hashlib over the whole file read at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import pytest

from gym_ray.errors import ConfigError, UsageError
from gym_ray.record.shard_files import (
    ShardLock,
    file_sha256,
    list_shards,
    record_identity,
    shard_paths,
    validate_shard_label,
)


def test_shard_paths_name_every_file_of_the_shard(tmp_path: Path) -> None:
    p = shard_paths(tmp_path, "shard-0007")
    assert p.run_dir == tmp_path
    assert p.shard == "shard-0007"
    assert p.successes == tmp_path / "rollouts-shard-0007.jsonl"
    assert p.failures == tmp_path / "rollouts-shard-0007_failures.jsonl"
    assert p.materialized_inputs == tmp_path / "rollouts-shard-0007_materialized_inputs.jsonl"
    assert p.manifest == tmp_path / "rollouts-shard-0007.manifest.json"
    assert p.progress == tmp_path / "rollouts-shard-0007.progress.json"
    assert p.lock == tmp_path / "rollouts-shard-0007.lock"
    assert list(tmp_path.iterdir()) == []  # nothing is created


@pytest.mark.parametrize("label", ["a", "A.b_c-9", "x" * 200, "a.b", "failures", "x_failures-1"])
def test_valid_labels_are_returned_unchanged(label: str) -> None:
    assert validate_shard_label(label) == label


@pytest.mark.parametrize(
    ("label", "problem"),
    [
        ("", "must be a non-empty string"),
        (7, "must be a non-empty string"),
        ("x" * 201, "is 201 characters long; the limit is 200"),
        ("a/b", "may only contain letters, digits, '.', '_' and '-' (no path separators)"),
        ("a b", "may only contain letters, digits, '.', '_' and '-' (no path separators)"),
        ("a\n", "may only contain letters, digits, '.', '_' and '-' (no path separators)"),
        ("a..b", "must not contain '..'"),
        ("..", "must not contain '..'"),
        ("x_failures", "must not end in '_failures' or '_materialized_inputs' (reserved for sidecar files)"),
        (
            "x_materialized_inputs",
            "must not end in '_failures' or '_materialized_inputs' (reserved for sidecar files)",
        ),
    ],
)
def test_invalid_labels_are_refused_with_the_reason(label: object, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_shard_label(label)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"shard label {label!r} {problem}; choose a label like 'shard-0007'")
    assert caught.value.key == "shard"
    with pytest.raises(ConfigError):
        shard_paths("/tmp", label)  # type: ignore[arg-type]


def test_list_shards_finds_every_label_once_from_any_of_its_files(tmp_path: Path) -> None:
    names = [
        "rollouts-a.jsonl",
        "rollouts-a_failures.jsonl",
        "rollouts-b_materialized_inputs.jsonl",  # a shard known only by its inputs file
        "rollouts-c.manifest.json",
        "rollouts-d.progress.json",
        "rollouts-e.lock",
        "rollouts-f_failures.jsonl",  # label "f", not "f_failures"
        "rollouts-g.h.jsonl",  # dots are allowed in labels
        "rollouts-..jsonl",  # label "." (one dot is allowed)
        "rollouts-x..y.jsonl",  # ".." is refused: skipped
        "rollouts-.jsonl",  # empty label: skipped
        "rollouts-z.txt",  # no known suffix
        "other-a.jsonl",  # not a shard file
        "rollouts-k_failures_failures.jsonl",  # label "k_failures" is reserved: skipped
    ]
    # other files, many of them, so that the listing meets some before the shard files whatever its order
    names += [f"notes-{i}.txt" for i in range(30)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert list_shards(tmp_path) == [".", "a", "b", "c", "d", "e", "f", "g.h"]


def test_list_shards_of_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert list_shards(tmp_path / "missing") == []
    assert list_shards(tmp_path) == []


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"_ng_task_index": 3, "_ng_rollout_index": 0}, (3, 0)),
        ({"_ng_task_index": 0, "_ng_rollout_index": 5, "x": 1}, (0, 5)),
        ({"_ng_task_index": True, "_ng_rollout_index": 0}, None),  # a bool is not an index
        ({"_ng_task_index": 1, "_ng_rollout_index": False}, None),
        ({"_ng_task_index": 1.0, "_ng_rollout_index": 0}, None),
        ({"_ng_task_index": "1", "_ng_rollout_index": 0}, None),
        ({"_ng_task_index": 1}, None),
        ({"_ng_rollout_index": 1}, None),
        ({}, None),
    ],
)
def test_record_identity_is_the_pair_of_int_indexes(record: dict[str, object], expected: object) -> None:
    assert record_identity(record) == expected


@pytest.mark.parametrize("size", [0, 5, (1 << 20) - 1, 1 << 20, (1 << 20) * 2 + 3])
def test_file_sha256_is_the_digest_of_the_whole_file(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_lock_file_token_round_trip_replaces_the_content_in_place(tmp_path: Path) -> None:
    path = tmp_path / "rollouts-s.lock"
    lock = ShardLock(path)
    assert lock.path == path
    with pytest.raises(UsageError, match=rf"^lock {path} is not open; call open\(\) first$"):
        _ = lock.fd
    assert not path.exists()  # nothing is opened before open()
    lock.open()
    fd = lock.fd
    lock.open()  # a second open keeps the same descriptor
    assert lock.fd == fd
    assert path.stat().st_mode & 0o777 == 0o644 & ~_umask()
    inode = path.stat().st_ino
    with lock.held():
        assert lock.read_token() == b""
        lock.write_token(b"a-long-first-token")
        lock.write_token(b"short")  # the old, longer content is gone
        assert lock.read_token() == b"short"
        assert lock.read_token(limit=3) == b"sho"
        lock.write_token(b"")
        assert lock.read_token() == b""
        assert path.stat().st_size == 0
    big = bytes(range(256)) * 64  # 16 KiB: more than one pwrite may take
    with lock.held():
        lock.write_token(big)
        assert lock.read_token(limit=len(big)) == big
        assert lock.read_token() == big[:4096]
    lock.close()
    lock.close()  # idempotent
    with pytest.raises(UsageError):
        _ = lock.fd
    assert path.read_bytes() == big  # the file stays, with its content, on the same inode
    assert path.stat().st_ino == inode
    again = ShardLock(path)
    again.open()  # reopening does not truncate
    with again.held():
        assert again.read_token(limit=len(big)) == big
    again.close()


def test_held_lock_excludes_other_descriptions_until_released(tmp_path: Path) -> None:
    path = tmp_path / "rollouts-s.lock"
    lock = ShardLock(path)
    lock.open()
    other = os.open(path, os.O_RDWR)
    try:
        with lock.held():
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released at the end of the block
        fcntl.flock(other, fcntl.LOCK_UN)
        with pytest.raises(RuntimeError, match="inside"), lock.held():
            raise RuntimeError("inside")
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the block raised, too
        fcntl.flock(other, fcntl.LOCK_UN)
    finally:
        os.close(other)
        lock.close()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

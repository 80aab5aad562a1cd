"""The object-store layer against a real S3 API (moto's server): URLs, conditional writes, shard leases,
segments, and what a zombie writer or a crash between two writes leaves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gym_ray.errors import ConfigError, ShardLockError
from gym_ray.record.shard_files import shard_paths
from gym_ray.store import objects
from gym_ray.store.mirror import Mirror
from gym_ray.store.objects import ObjectStore, StoreConflict, StoreError, parse_store_url
from gym_ray.store.segments import ShardLease, read_head, restore_shard
from tests.store.conftest import Bucket


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://runs/sweeps/r1/", ("runs", "sweeps/r1")),
        ("s3://my.bucket-2", ("my.bucket-2", "")),
        ("S3://runs/a", ("runs", "a")),
    ],
)
def test_a_store_url_names_a_bucket_and_a_prefix(url: str, expected: tuple[str, str]) -> None:
    parsed = parse_store_url(url)
    assert (parsed.bucket, parsed.prefix) == expected
    assert parsed.key("rollouts.jsonl") == (
        f"{expected[1]}/rollouts.jsonl" if expected[1] else "rollouts.jsonl"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://bucket/run", "gs:// is not supported; a run folder is a local path or s3://BUCKET/PREFIX"),
        ("s3://AKIA:secret@bucket/run", "put no credentials or port in the URL"),
        ("s3://Bad_Bucket/run", "'Bad_Bucket' is not an S3 bucket name"),
        ("s3://runs/a/../b", "the prefix may not hold empty, '.' or '..' parts"),
        ("s3://runs/a//b", "the prefix may not hold empty, '.' or '..' parts"),
    ],
)
def test_a_bad_store_url_is_refused_saying_what_to_give(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match="output_dir") as caught:
        parse_store_url(url)
    assert message in str(caught.value)


def test_conditional_writes_are_decided_by_the_store(bucket: Bucket) -> None:
    store = ObjectStore(bucket.url("r"))
    first = store.put("head.json", b"1", create=True)
    with pytest.raises(StoreConflict):
        store.put("head.json", b"2", create=True)  # the key is taken
    second = store.put("head.json", b"3", if_match=first)
    with pytest.raises(StoreConflict):
        store.put("head.json", b"4", if_match=first)  # replaced since
    assert store.get("head.json") == (b"3", second)
    assert store.get("absent.json") is None
    assert store.requests == 6


def test_a_large_file_goes_up_in_parts_and_arrives_whole(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)  # S3's smallest part
    data = b"".join(b'{"line": %d}\n' % i for i in range(900_000))  # 13 MB: three parts
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(data)
    store = ObjectStore(bucket.url("r"))
    store.upload("rollouts.jsonl", path)
    assert bucket.read("r/rollouts.jsonl") == data
    assert bucket.client.head_object(Bucket=bucket.name, Key="r/rollouts.jsonl")["ETag"].endswith('-3"')


def test_a_missing_bucket_is_one_clear_error(bucket: Bucket) -> None:
    with pytest.raises(
        StoreError, match=r"s3://no-such-bucket-here/r: listing the bucket failed: .*NoSuchBucket"
    ):
        ObjectStore("s3://no-such-bucket-here/r").check()


def _append(path: Path, *lines: str, tail: str = "") -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines) + tail)


def test_a_publication_commits_whole_lines_and_a_new_owner_gets_exactly_them(
    bucket: Bucket, tmp_path: Path
) -> None:
    store = ObjectStore(bucket.url("r"))
    first = ShardLease(store, tmp_path / "a", "00000").take()
    paths = shard_paths(tmp_path / "a", "00000")
    _append(paths.successes, '{"i": 0}', '{"i": 1}', tail='{"i": 2')  # a line still being written
    _append(paths.attempt_log, "a0")
    assert first.publish() == 2
    assert first.publish() == 0  # nothing new: no request
    _append(paths.successes, "}")
    _append(paths.failures, '{"f": 0}')
    assert first.publish() == 2
    second = ShardLease(store, tmp_path / "b", "00000").take()
    copy = shard_paths(tmp_path / "b", "00000")
    assert copy.successes.read_bytes() == b'{"i": 0}\n{"i": 1}\n{"i": 2}\n'
    assert copy.failures.read_bytes() == b'{"f": 0}\n'
    assert copy.attempt_log.read_bytes() == b"a0\n"
    assert (second.head.epoch, first.head.epoch) == (2, 1)


def test_a_zombie_writers_late_publication_is_refused_by_the_store(bucket: Bucket, tmp_path: Path) -> None:
    store = ObjectStore(bucket.url("r"))
    zombie = ShardLease(store, tmp_path / "a", "00000").take()
    old = shard_paths(tmp_path / "a", "00000")
    _append(old.successes, '{"i": 0}')
    zombie.publish()
    heir = ShardLease(store, tmp_path / "b", "00000").take()  # the shard handed to another worker
    _append(old.successes, '{"i": 1, "late": true}')  # the zombie goes on writing on its own disk
    with pytest.raises(ShardLockError, match=r"another writer took the shard .* the store refused"):
        zombie.publish()
    new = shard_paths(tmp_path / "b", "00000")
    _append(new.successes, '{"i": 1}')
    heir.publish()
    reader = tmp_path / "reader"
    got = read_head(store, "00000")
    assert got is not None
    restore_shard(store, reader, "00000", got[0])
    assert shard_paths(reader, "00000").successes.read_bytes() == b'{"i": 0}\n{"i": 1}\n'
    segments = [key for key in bucket.keys("r/.gym_ray_shards/00000/") if key.endswith(".seg")]
    assert segments == [  # the zombie's refused segment is not left behind
        "r/.gym_ray_shards/00000/e000001-s000001.seg",
        "r/.gym_ray_shards/00000/e000002-s000001.seg",
    ]


def test_a_segment_written_before_a_crash_and_never_committed_is_not_read(
    bucket: Bucket, tmp_path: Path
) -> None:
    store = ObjectStore(bucket.url("r"))
    lease = ShardLease(store, tmp_path / "a", "00000").take()
    paths = shard_paths(tmp_path / "a", "00000")
    _append(paths.successes, '{"i": 0}')
    lease.publish()
    # the writer put its next segment, then died before writing the head
    store.put(".gym_ray_shards/00000/e000001-s000002.seg", b'{"i": 1}\n', create=True)
    ShardLease(store, tmp_path / "b", "00000").take()
    assert shard_paths(tmp_path / "b", "00000").successes.read_bytes() == b'{"i": 0}\n'


def test_taking_a_shard_replaces_whatever_a_local_copy_held(bucket: Bucket, tmp_path: Path) -> None:
    # lines a dead writer left on this disk without publishing them are not records: they run again
    store = ObjectStore(bucket.url("r"))
    paths = shard_paths(tmp_path / "a", "00000")
    paths.run_dir.mkdir(parents=True)
    _append(paths.successes, '{"i": 9}')
    Path(f"{paths.successes}.idx").write_bytes(b"stale index")
    ShardLease(store, tmp_path / "a", "00000").take()
    assert not paths.successes.exists()
    assert not Path(f"{paths.successes}.idx").exists()


def test_a_mirror_pushes_what_it_wrote_and_pulls_what_it_lacks(bucket: Bucket) -> None:
    writer = Mirror(ObjectStore(bucket.url("r")))
    (writer.stage / "run_manifest.json").write_text("{}")
    (writer.stage / "rollouts-00000_materialized_inputs.jsonl").write_text('{"x": 1}\n')
    (writer.stage / "rollouts-00000.jsonl").write_text("{}\n")  # a record file: segments only
    (writer.stage / "rollouts-00000.lock").write_text("token")  # local only
    assert writer.push_changed() == ["rollouts-00000_materialized_inputs.jsonl", "run_manifest.json"]
    assert writer.push_changed() == []  # unchanged: nothing sent again
    reader = Mirror(ObjectStore(bucket.url("r")))
    assert reader.pull_files() == ["rollouts-00000_materialized_inputs.jsonl", "run_manifest.json"]
    assert reader.pull_files() == []
    assert (reader.stage / "rollouts-00000_materialized_inputs.jsonl").read_text() == '{"x": 1}\n'
    assert reader.url_of(reader.stage / "rollouts.jsonl") == f"s3://{bucket.name}/r/rollouts.jsonl"
    for mirror in (writer, reader):
        mirror.close()
        assert not mirror.stage.exists()


def test_a_new_mirror_removes_the_stages_of_processes_that_are_gone(bucket: Bucket) -> None:
    first = Mirror(ObjectStore(bucket.url("r")))
    dead = first.stage.parent / "999999999-abcdef"  # no such pid: a killed process's leftover
    dead.mkdir()
    (dead / "rollouts-00000.jsonl").write_text("{}\n")
    second = Mirror(ObjectStore(bucket.url("r")))
    left = sorted(p.name for p in first.stage.parent.iterdir())
    assert left == sorted([first.stage.name, second.stage.name])
    first.close()
    second.close()


def test_without_boto3_a_store_folder_asks_for_the_s3_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed: its import raises
    with pytest.raises(ConfigError) as caught:
        ObjectStore("s3://runs/r1")
    assert str(caught.value) == (
        "a run folder on s3:// needs boto3: pip install boto3 (or gym-ray's s3 extra, pip install -e '.[s3]' "
        "in its checkout)"
    )

"""The shard writer: labels, routing, ownership, torn-tail repair, I/O failure, manifest and progress."""

from __future__ import annotations

import errno
import json
import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError, ShardIOError, ShardLockError, UsageError
from gym_ray.record.jsonl import JsonlReader, encode_line, repair_torn_tail
from gym_ray.record.manifest import ShardManifest, build_manifest, read_manifest
from gym_ray.record.shard_files import list_shards, shard_paths
from gym_ray.record.writer import ShardWriter


def row(task: int, rollout: int, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, **extra}


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def writer(run_dir: Path, shard: str = "s0", **kwargs: Any) -> ShardWriter:
    kwargs.setdefault("run_id", "run-1")
    kwargs.setdefault("config_identity", "cfg-a")
    return ShardWriter(run_dir, shard, **kwargs)


# --- labels -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "fragment"),
    [
        pytest.param("", "non-empty", id="empty"),
        pytest.param("a/b", "path separators", id="slash"),
        pytest.param("..", "'..'", id="dotdot"),
        pytest.param("a..b", "'..'", id="inner-dotdot"),
        pytest.param("a b", "path separators", id="space"),
        pytest.param("x" * 201, "limit is 200", id="too-long"),
        pytest.param("s0_failures", "reserved", id="reserved-failures"),
        pytest.param("s0_materialized_inputs", "reserved", id="reserved-inputs"),
    ],
)
def test_bad_shard_label_is_rejected_naming_it(tmp_path: Path, label: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        writer(tmp_path, label)
    assert repr(label)[:40] in str(info.value)
    assert fragment in str(info.value)
    assert info.value.key == "shard"
    assert list(tmp_path.iterdir()) == []


def test_files_are_named_per_protocol_and_discovered(tmp_path: Path) -> None:
    with writer(tmp_path, "shard-7.a") as w:
        w.write_materialized_inputs([row(0, 0)])
        w.write_progress()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "rollouts-shard-7.a.jsonl",
        "rollouts-shard-7.a.jsonl.idx",  # the line indexes, for the merge (gym_ray.record.line_index)
        "rollouts-shard-7.a.lock",
        "rollouts-shard-7.a.progress.json",
        "rollouts-shard-7.a_failures.jsonl",
        "rollouts-shard-7.a_failures.jsonl.idx",
        "rollouts-shard-7.a_materialized_inputs.jsonl",
    ]
    (tmp_path / "rollouts.jsonl").write_text("")
    assert list_shards(tmp_path) == ["shard-7.a"]


# --- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "keep_omitted", "target"),
    [
        pytest.param(row(0, 0, reward=1.0), False, "successes", id="success"),
        pytest.param(row(0, 0, _ng_failure_class="agent_run_error"), False, "failures", id="failure"),
        pytest.param(
            row(0, 0, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True),
            False,
            None,
            id="omitted-dropped",
        ),
        pytest.param(
            row(0, 0, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True),
            True,
            "failures",
            id="omitted-recorded",
        ),
        pytest.param(row(0, 0, _ng_no_persist=True), True, "failures", id="omitted-no-class-recorded"),
        pytest.param(row(0, 0, _ng_failure_class="kill_shaped"), True, None, id="kill-shaped-never-written"),
        pytest.param(row(0, 0, _ng_no_persist=False, reward=0.0), False, "successes", id="no-persist-false"),
    ],
)
def test_append_routes_each_record_to_its_file(
    tmp_path: Path, record: dict[str, Any], keep_omitted: bool, target: str | None
) -> None:
    paths = shard_paths(tmp_path, "s0")
    with writer(tmp_path, record_omitted_rollouts=keep_omitted) as w:
        written = w.append(record)
    expected = None if target is None else getattr(paths, target)
    assert written == expected
    for name in ("successes", "failures"):
        path = getattr(paths, name)
        assert lines_of(path) == ([record] if name == target else [])


def test_lines_are_compact_utf8_json_one_per_record(tmp_path: Path) -> None:
    record = row(3, 1, text="héllo\nworld ✓", nested={"a": [1, 2]})
    with writer(tmp_path) as w:
        w.append(record)
        w.append(row(3, 2))
    data = shard_paths(tmp_path, "s0").successes.read_bytes()
    assert (
        data
        == (
            '{"_ng_task_index":3,"_ng_rollout_index":1,"text":"héllo\\nworld ✓","nested":{"a":[1,2]}}\n'
            '{"_ng_task_index":3,"_ng_rollout_index":2}\n'
        ).encode()
    )


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        pytest.param(row(1, 2, bad={1, 2}), "record 1-2", id="set-value"),
        pytest.param(row(1, 2, bad="\ud800"), "record 1-2", id="lone-surrogate"),
    ],
)
def test_unserializable_record_is_a_usage_error_and_writes_nothing(
    tmp_path: Path, record: dict[str, Any], fragment: str
) -> None:
    with writer(tmp_path) as w:
        with pytest.raises(UsageError, match=fragment):
            w.append(record)
        assert w.append(row(0, 0)) is not None
    assert lines_of(shard_paths(tmp_path, "s0").successes) == [row(0, 0)]


# --- lifecycle and ownership (in one process; tests/chaos covers processes) -----------------------


def test_writer_refuses_use_before_open_and_reopen_after_close(tmp_path: Path) -> None:
    w = writer(tmp_path)
    with pytest.raises(UsageError, match="open"):
        w.append(row(0, 0))
    w.open()
    w.close()
    w.close()
    with pytest.raises(UsageError, match=r"^ShardWriter for shard 's0' is closed; create a new writer$"):
        w.open()
    with pytest.raises(UsageError, match=r"^ShardWriter for shard 's0' is closed; open\(\) it first$"):
        w.append(row(0, 0))


def test_a_writer_closed_before_it_was_opened_cannot_be_opened(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.close()
    with pytest.raises(UsageError, match=r"^ShardWriter for shard 's0' is closed; create a new writer$"):
        w.open()
    assert list(tmp_path.iterdir()) == []


def test_a_record_that_is_not_a_dict_is_refused_naming_its_type(tmp_path: Path) -> None:
    with writer(tmp_path) as w, pytest.raises(UsageError) as info:
        w.append([1])  # type: ignore[arg-type]
    assert str(info.value) == "shard 's0': a record must be a dict, got list"


def test_open_creates_missing_parent_folders_and_record_files_without_exec_bits(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "b"
    with writer(run_dir) as w:
        w.append(row(0, 0))
    umask = os.umask(0)
    os.umask(umask)
    paths = shard_paths(run_dir, "s0")
    assert [p.stat().st_mode & 0o777 for p in (paths.successes, paths.failures)] == [0o644 & ~umask] * 2


def test_a_failed_open_names_the_folder_and_the_writer_takes_no_more_use(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    w = writer(tmp_path / "file" / "run")
    with pytest.raises(ShardIOError) as info:
        w.open()
    assert str(info.value).startswith(
        f"shard 's0': opening in {tmp_path / 'file' / 'run'} failed ([Errno 20]"
    )
    assert str(info.value).endswith("; check the folder's permissions and free space")
    with pytest.raises(UsageError, match=r"^ShardWriter for shard 's0' is failed; create a new writer$"):
        w.open()


@pytest.mark.parametrize(
    ("target", "write"),
    [
        pytest.param("progress", lambda w: w.write_progress(), id="progress"),
        pytest.param("materialized_inputs", lambda w: w.write_materialized_inputs([row(0, 0)]), id="inputs"),
        pytest.param(
            "manifest",
            lambda w: w.write_manifest(
                build_manifest(w.paths.run_dir, "s0", run_id="run-1", config_identity=None)
            ),
            id="manifest",
        ),
    ],
)
def test_a_failed_replace_fails_the_shard_naming_the_file(tmp_path: Path, target: str, write: Any) -> None:
    paths = shard_paths(tmp_path, "s0")
    with writer(tmp_path) as w:
        if target == "manifest":
            w.write_materialized_inputs([row(0, 0)])
        getattr(paths, target).mkdir()  # a folder where the file goes: os.replace fails with EISDIR
        with pytest.raises(ShardIOError) as info:
            write(w)
        assert str(info.value).startswith(
            f"shard 's0': writing {getattr(paths, target)} failed: EISDIR Is a directory. The shard is failed"
        )
        with pytest.raises(ShardIOError, match=r"is failed \(writing .* failed: EISDIR"):
            w.append(row(0, 0))


@pytest.mark.parametrize(
    ("every", "syncing_appends"),
    [pytest.param(None, [256], id="default-256"), pytest.param(1, [1, 2, 3], id="every-record")],
)
def test_files_are_fsynced_every_fsync_every_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int | None, syncing_appends: list[int]
) -> None:
    kwargs = {} if every is None else {"fsync_every": every}
    count = 300 if every is None else 3
    calls: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    with writer(tmp_path, **kwargs) as w:
        monkeypatch.setattr(os, "fsync", spy)
        syncing = []
        for number in range(1, count + 1):
            before = len(calls)
            w.append(row(number, 0))
            if len(calls) > before:
                syncing.append(number)
    assert syncing == syncing_appends
    assert len(lines_of(shard_paths(tmp_path, "s0").successes)) == count


@pytest.mark.parametrize("value", [pytest.param(0, id="zero"), pytest.param(-1, id="negative")])
def test_fsync_every_must_be_positive(tmp_path: Path, value: int) -> None:
    with pytest.raises(ConfigError, match=f"fsync_every={value}") as info:
        writer(tmp_path, fsync_every=value)
    assert info.value.key == "fsync_every"


def test_kept_omitted_rows_count_as_omitted_now_and_after_reopening(tmp_path: Path) -> None:
    drained = {keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True}
    with writer(tmp_path, record_omitted_rollouts=True) as w:
        w.write_materialized_inputs([row(0, 0), row(1, 0), row(2, 0)])
        for record in (row(0, 0, **drained), row(1, 0, **drained), row(2, 0, reward=1.0)):
            w.append(record)
        counts = w.progress().model_dump(include={"planned", "succeeded", "failed", "omitted", "attempts"})
    expected = {"planned": 3, "succeeded": 1, "failed": {}, "omitted": 2, "attempts": 1}
    assert counts == expected
    assert len(lines_of(shard_paths(tmp_path, "s0").failures)) == 2
    with writer(tmp_path) as reopened:
        assert reopened.progress().model_dump(include=set(expected)) == expected


def test_no_materialized_rows_plan_zero(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.write_materialized_inputs([])
        assert w.progress().planned == 0


def test_second_opener_takes_the_shard_and_the_first_writes_nothing(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    first = writer(tmp_path).open()
    first.append(row(0, 0, who="first"))
    inode = paths.lock.stat().st_ino
    second = writer(tmp_path).open()
    with pytest.raises(ShardLockError) as info:
        first.append(row(0, 1, who="first"))
    message = str(info.value)
    assert "shard 's0' was opened by another writer since this writer opened it" in message
    assert f"pid {os.getpid()}" in message
    with pytest.raises(ShardLockError):
        first.write_progress()
    second.append(row(0, 1, who="second"))
    first.close()
    second.close()
    assert [r["who"] for r in lines_of(paths.successes)] == ["first", "second"]
    assert paths.lock.stat().st_ino == inode
    token = json.loads(paths.lock.read_bytes())
    assert sorted(token) == ["host", "opened_at", "pid", "run_id", "token"]


def test_a_stale_writer_names_a_new_holder_whose_token_is_longer_than_its_own(tmp_path: Path) -> None:
    """The holder is named whatever the two tokens' lengths (the check reads only as much as its own)."""
    first = writer(tmp_path, clock=lambda: 1.0).open()  # "opened_at":1.0
    second = writer(tmp_path, clock=lambda: 1764630000.1234567).open()  # 15 bytes longer
    with pytest.raises(ShardLockError) as info:
        first.append(row(0, 0))
    assert f"(a newer worker owns it: pid {os.getpid()} on {socket.gethostname()})" in str(info.value)
    assert (info.value.holder_pid, info.value.holder_host) == (os.getpid(), socket.gethostname())
    first.close()
    second.close()


# --- torn tails -----------------------------------------------------------------------------------


def _write_records(path: Path, count: int) -> list[bytes]:
    lines = [encode_line(row(i, 0, payload="p" * (i % 7))) for i in range(count)]
    path.write_bytes(b"".join(lines))
    return lines


@pytest.mark.parametrize(
    ("garbage", "mid_line", "kept_extra"),
    [
        pytest.param(b"\x8f\x00junk{", True, 0, id="binary-no-newline"),
        pytest.param(b"\x00" * 4096, True, 0, id="zero-block"),
        pytest.param(b'{"half":\nmore garbage\n\x00\x00', True, 0, id="garbage-spanning-lines"),
        pytest.param(b"\n\n  \n", True, 0, id="blank-lines"),
        pytest.param(b"", True, 0, id="plain-truncation"),
        pytest.param(b'{"tail":1}', False, 1, id="parseable-tail-gets-newline"),
        pytest.param(b'{"tail":', False, 0, id="partial-line-at-boundary"),
    ],
)
def test_open_repairs_a_power_loss_tail(
    tmp_path: Path, garbage: bytes, mid_line: bool, kept_extra: int
) -> None:
    paths = shard_paths(tmp_path, "s0")
    lines = _write_records(paths.successes, 20)
    cut = sum(len(line) for line in lines[:12]) + (len(lines[12]) // 2 if mid_line else 0)
    with paths.successes.open("r+b") as handle:
        handle.truncate(cut)
        handle.seek(cut)
        handle.write(garbage)
    # Simulated power loss: lines after the cut are gone and garbage follows; whole lines 1-12 survive.
    with writer(tmp_path) as w:
        w.append(row(99, 0))
    records = lines_of(paths.successes)
    assert records[:12] == [json.loads(line) for line in lines[:12]]
    assert records[12:] == ([{"tail": 1}] if kept_extra else []) + [row(99, 0)]


def test_repair_drops_only_the_tail_and_keeps_a_corrupt_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a":1}\nnot json\n{"b":2}\n{"c":')
    fd = os.open(path, os.O_RDWR)
    try:
        repair = repair_torn_tail(fd)
    finally:
        os.close(fd)
    assert (repair.dropped_bytes, repair.dropped_lines, repair.added_newline) == (5, 1, False)
    assert path.read_bytes() == b'{"a":1}\nnot json\n{"b":2}\n'
    reader = JsonlReader(path)
    assert [record for _, record in reader] == [{"a": 1}, {"b": 2}]
    assert reader.corrupt_lines == [2]
    with pytest.raises(InputError, match=r"f\.jsonl:2: not a JSON object"):
        list(JsonlReader(path, strict=True))


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(
        st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=8) | st.none(), max_size=3),
        max_size=6,
    ),
    tail=st.binary(max_size=64),
    cut=st.integers(min_value=0, max_value=40),
)
def test_reader_and_repair_survive_any_tail(
    tmp_path_factory: pytest.TempPathFactory, records: list[dict[str, Any]], tail: bytes, cut: int
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "f.jsonl"
    whole = b"".join(encode_line(record) for record in records)
    torn = encode_line({"torn": "x" * 40})[:cut]
    path.write_bytes(whole + torn + tail)
    reader = JsonlReader(path)
    read = [record for _, record in reader]
    assert read[: len(records)] == records
    fd = os.open(path, os.O_RDWR)
    try:
        repair_torn_tail(fd)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data.startswith(whole)
    assert data == b"" or data.endswith(b"\n")
    repaired = JsonlReader(path)
    after = [record for _, record in repaired]
    assert after[: len(records)] == records
    assert not repaired.torn_tail
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    assert data == b"" or json.loads(last) == after[-1]


# --- I/O failure ----------------------------------------------------------------------------------


def test_full_disk_fails_the_shard_and_later_appends_refuse(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    paths.successes.symlink_to("/dev/full")  # a real device whose every write fails with ENOSPC
    w = writer(tmp_path).open()
    with pytest.raises(ShardIOError, match=r"appending to .*rollouts-s0\.jsonl failed: ENOSPC"):
        w.append(row(0, 0))
    with pytest.raises(ShardIOError, match=r"is failed .*ENOSPC.*takes no more writes"):
        w.append(row(0, 1, _ng_failure_class="agent_run_error"))
    with pytest.raises(ShardIOError, match="is failed"):
        w.checkpoint()
    w.close()
    w.close()
    assert paths.failures.read_bytes() == b""


def test_failed_fsync_is_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = shard_paths(tmp_path, "s0")
    paths.successes.symlink_to("/dev/null")  # writes succeed, fsync fails (EINVAL), as on a bad disk
    calls: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    w = writer(tmp_path, fsync_every=2).open()
    monkeypatch.setattr(os, "fsync", spy)
    assert w.append(row(0, 0)) == paths.successes
    with pytest.raises(ShardIOError, match=r"fsync of .*rollouts-s0\.jsonl failed: EINVAL"):
        w.append(row(0, 1))
    assert len(calls) == 1
    with pytest.raises(ShardIOError, match="is failed"):
        w.append(row(0, 2))
    w.close()
    assert len(calls) == 1


def test_short_writes_are_continued_into_one_whole_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write

    def short_write(fd: int, data: bytes | memoryview) -> int:
        return real_write(fd, bytes(data[:3]))

    with writer(tmp_path) as w:
        monkeypatch.setattr(os, "write", short_write)
        w.append(row(5, 0, text="abcdefgh"))
        monkeypatch.undo()
    assert lines_of(shard_paths(tmp_path, "s0").successes) == [row(5, 0, text="abcdefgh")]


def test_write_failing_mid_line_leaves_a_tail_the_next_writer_repairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mocked: a disk that fills up halfway through a line cannot be had on demand.
    real_write = os.write
    state = {"calls": 0}

    def fill_up(fd: int, data: bytes | memoryview) -> int:
        state["calls"] += 1
        if state["calls"] == 1:
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    paths = shard_paths(tmp_path, "s0")
    w = writer(tmp_path).open()
    w.append(row(0, 0))
    monkeypatch.setattr(os, "write", fill_up)
    with pytest.raises(ShardIOError, match="ENOSPC"):
        w.append(row(0, 1, text="x" * 50))
    monkeypatch.undo()
    w.close()
    assert paths.successes.read_bytes().count(b"\n") == 1
    with writer(tmp_path) as again:
        again.append(row(0, 1))
    assert lines_of(paths.successes) == [row(0, 0), row(0, 1)]


# --- materialized inputs, manifest, progress --------------------------------------------------------


def test_materialized_inputs_manifest_and_progress(tmp_path: Path) -> None:
    rows = [row(0, 0), row(0, 1), row(1, 0, _ng_attempt_index=2)]
    ticks = iter([100.0, 101.0, 102.0, 103.0])
    paths = shard_paths(tmp_path, "s0")
    with writer(tmp_path, clock=lambda: next(ticks)) as w:
        digest = w.write_materialized_inputs(rows)
        manifest = build_manifest(
            tmp_path, "s0", run_id="run-1", config_identity="cfg-a", max_rollout_attempts=4, clock=lambda: 7.0
        )
        w.write_manifest(manifest)
        w.append(row(0, 0, reward=1.0))
        w.append(row(0, 0, reward=1.0))
        w.append(row(0, 1, _ng_failure_class="agent_run_error"))
        w.append(row(0, 1, _ng_failure_class="timeout_exceeded", _ng_failure_terminal=True))
        w.append(row(1, 0, _ng_failure_class="cancelled", _ng_no_persist=True))
        progress = w.write_progress()
    assert paths.materialized_inputs.read_bytes() == b"".join(encode_line(r) for r in rows)
    assert manifest.inputs_digest == digest
    assert manifest.model_dump(exclude={"gym_ray_version"}) == {
        "format_version": 1,
        "run_id": "run-1",
        "shard": "s0",
        "config_identity": "cfg-a",
        "inputs_digest": digest,
        "num_rows": 3,
        "max_rollout_attempts": 4,
        "created_at": 7.0,
        "attempt_plan": ((0, 0, 0), (0, 1, 0), (1, 0, 2)),
    }
    assert read_manifest(tmp_path, "s0") == manifest
    assert progress.model_dump() == {
        "run_id": "run-1",
        "shard": "s0",
        "planned": 3,
        "succeeded": 1,
        "failed": {"agent_run_error": 1, "timeout_exceeded": 1},
        "terminal_failed": 1,
        "omitted": 1,
        "attempts": 4,
        "updated_at": 101.0,
    }
    assert json.loads(paths.progress.read_bytes()) == progress.model_dump()
    with writer(tmp_path, clock=lambda: 500.0) as reopened:
        seeded = reopened.progress()
    assert seeded.model_dump(exclude={"omitted", "updated_at"}) == progress.model_dump(
        exclude={"omitted", "updated_at"}
    )
    assert seeded.omitted == 0


def test_bad_materialized_row_replaces_nothing(tmp_path: Path) -> None:
    paths = shard_paths(tmp_path, "s0")
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(0, 0)])
        with pytest.raises(UsageError, match="materialized row 2 is a list"):
            w.write_materialized_inputs([row(0, 0), [1]])  # type: ignore[list-item]
        with pytest.raises(UsageError, match=r"^shard 's0': materialized row 2 cannot be written as JSON"):
            w.write_materialized_inputs([row(0, 0), row(1, 0, bad={1, 2})])
    assert lines_of(paths.materialized_inputs) == [row(0, 0)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_manifest_for_another_shard_is_refused(tmp_path: Path) -> None:
    with writer(tmp_path) as w:
        w.write_materialized_inputs([row(0, 0)])
        manifest = build_manifest(tmp_path, "s0", run_id="run-1", config_identity=None)
        other = ShardManifest.model_validate({**manifest.model_dump(), "shard": "s1"})
        with pytest.raises(UsageError, match="shard 's1' given to the writer of run 'run-1' shard 's0'"):
            w.write_manifest(other)


def test_corrupt_manifest_names_the_file(tmp_path: Path) -> None:
    shard_paths(tmp_path, "s0").manifest.write_text("{not json")
    with pytest.raises(InputError, match=r"rollouts-s0\.manifest\.json: not a valid shard manifest"):
        read_manifest(tmp_path, "s0")


def test_a_manifest_of_the_wrong_shape_is_one_line_naming_each_problem(tmp_path: Path) -> None:
    path = shard_paths(tmp_path, "s0").manifest
    path.write_text('{"shard": 3, "run_id": "r", "num_rows": "many"}')
    with pytest.raises(InputError) as raised:
        read_manifest(tmp_path, "s0")
    assert str(raised.value) == (
        f"{path}: not a valid shard manifest (shard: Input should be a valid string; config_identity: Field "
        "required; inputs_digest: Field required; num_rows: Input should be a valid integer, unable to parse "
        "string as an integer; max_rollout_attempts: Field required; created_at: Field required; "
        "gym_ray_version: Field required; attempt_plan: Field required); restore it, or remove it to resume "
        "without verifying the inputs"
    )


def test_random_garbage_files_never_crash_open(tmp_path: Path) -> None:
    rng = random.Random(7)
    paths = shard_paths(tmp_path, "s0")
    for _ in range(20):
        paths.successes.write_bytes(rng.randbytes(rng.randrange(0, 300)))
        paths.failures.write_bytes(encode_line(row(1, 0, _ng_failure_class="x")) + rng.randbytes(20))
        with writer(tmp_path) as w:
            w.append(row(2, 0))
        assert lines_of(paths.failures)[0] == row(1, 0, _ng_failure_class="x")
        assert json.loads(paths.successes.read_bytes().splitlines()[-1]) == row(2, 0)

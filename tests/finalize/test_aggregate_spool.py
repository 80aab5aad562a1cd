"""The aggregation spool's contract on real files: bodies, replies, discards, stops and its file names.

Expected bytes come from the stdlib ``json`` module (an independent encoder) or are written by hand.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.errors import GymRayError, InternalError, RecordError, ServerResponseError, ValidationError
from gym_ray.finalize._aggregate_spool import (
    STOP_CHECK_ROWS,
    Fragment,
    ServerSpools,
    Stopped,
    group_results,
    run_joined,
    write_metrics_atomic,
)
from gym_ray.finalize.json_stream import EXCERPT_BYTES
from gym_ray.plan.rows import MAX_LISTED_ROWS
from tests.finalize.test_aggregate import _agent, _base_config


class _StopAfterFirstLook(threading.Event):
    """A stop event that the caller sets right after the work first looks at it (a cancellation that
    arrives while the work runs, at a known point)."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        was = super().is_set()
        self.set()
        return was


def _compact(values: list[dict[str, Any]]) -> bytes:
    return json.dumps({"verify_responses": values}, separators=(",", ":")).encode()


def _spools(tmp_path: Path, keyed: list[tuple[tuple[int, int], dict[str, Any]]]) -> ServerSpools:
    spools = ServerSpools(tmp_path)
    for key, value in keyed:
        spools.add("env", key, value)
    spools.finish()
    return spools


def test_an_unordered_spool_is_sorted_by_numeric_key_keeping_arrival_order_of_equal_keys(
    tmp_path: Path,
) -> None:
    # task 10 after task 9 (bytes would put "10" first); equal keys whose JSON bytes sort against arrival;
    # strings with spaces (the key prefix is split off at its first two spaces only)
    keyed = [
        ((10, 0), {"text": "ten a b"}),
        ((9, 1), {"text": "nine one"}),
        ((9, 0), {"z": "second  space", "n": 2}),
        ((9, 0), {"a": "third", "n": 3}),
        ((2, 12), {"text": " leading"}),
        ((2, 3), {"text": "trailing "}),
    ]
    spools = _spools(tmp_path, keyed)
    body = spools.write_body("env", threading.Event())
    expected = [keyed[i][1] for i in (5, 4, 2, 3, 1, 0)]
    assert body.read_bytes() == _compact(expected)
    spools.remove()


def test_an_ordered_spool_with_spaces_in_its_strings_is_sent_whole(tmp_path: Path) -> None:
    keyed = [((0, 0), {"text": "a b  c", "k": " "}), ((0, 1), {"text": "x y"}), ((3, 0), {"t": "1 2 3 4"})]
    spools = _spools(tmp_path, keyed)
    body = spools.write_body("env", threading.Event())
    assert body.read_bytes() == _compact([value for _, value in keyed])
    spools.remove()


def test_the_spool_folder_holds_numbered_spool_body_reply_and_fragment_files(tmp_path: Path) -> None:
    spools = ServerSpools(tmp_path)
    spools.add("first", (0, 0), {"a": 1})
    spools.add("second", (0, 0), {"b": 2})
    spools.finish()
    folder = spools.folder
    assert folder is not None
    assert sorted(os.listdir(folder)) == ["1-spool.jsonl", "2-spool.jsonl"]
    body = spools.write_body("second", threading.Event())
    assert body == folder / "2-body.json"
    assert spools.reply_path("second") == folder / "2-reply.json"
    spools.reply_path("second").write_text('{"group_level_metrics": [{"x": 1}], "key_metrics": {}}')
    parts = spools.read_reply("second", threading.Event(), keep=("key_metrics",), what="w", hint="h")
    assert parts.members == {"key_metrics": {}}
    assert {key: (f.path, f.count) for key, f in parts.fragments.items()} == {
        "group_level_metrics": (folder / "2-group_level_metrics.part", 1)
    }
    assert sorted(os.listdir(folder)) == ["1-spool.jsonl", "2-body.json", "2-group_level_metrics.part"]
    assert (folder / "2-group_level_metrics.part").read_text() == '      {\n        "x": 1\n      }'
    spools.remove()
    assert os.listdir(tmp_path) == []


def test_discard_drops_only_that_servers_spool_and_forgets_it(tmp_path: Path) -> None:
    spools = ServerSpools(tmp_path)
    spools.add("kept", (0, 0), {"a": 1})
    spools.add("dropped", (0, 0), {"b": 2})
    spools.discard("dropped")
    spools.discard("never-added")  # nothing to drop: no error
    spools.finish()
    folder = spools.folder
    assert folder is not None
    assert os.listdir(folder) == ["1-spool.jsonl"]
    with pytest.raises(KeyError):
        spools.write_body("dropped", threading.Event())
    assert spools.write_body("kept", threading.Event()).read_bytes() == _compact([{"a": 1}])
    spools.remove()


def test_discard_after_the_body_is_written_is_fine(tmp_path: Path) -> None:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    body = spools.write_body("env", threading.Event())
    spools.discard("env")
    assert body.read_bytes() == _compact([{"a": 1}])
    spools.remove()


def test_a_spool_that_cannot_be_removed_is_a_record_error_naming_the_folder_and_the_fix(
    tmp_path: Path,
) -> None:
    spools = ServerSpools(tmp_path)
    spools.add("env", (0, 0), {"a": 1})
    spools.finish()
    folder = spools.folder
    assert folder is not None
    (folder / "1-spool.jsonl").unlink()
    (folder / "1-spool.jsonl").mkdir()  # unlink() of a folder fails with EISDIR, even for root
    with pytest.raises(RecordError) as caught:
        spools.discard("env")
    assert str(caught.value) == (
        f"cannot write the aggregation spool in {folder}: [Errno 21] Is a directory: "
        f"'{folder / '1-spool.jsonl'}'; free space or fix permissions there (it sits beside the metrics "
        "file), then run `gym-ray aggregate RUN_DIR CONFIG` again"
    )
    spools.remove()
    assert os.listdir(tmp_path) == []


def test_a_body_that_cannot_be_written_is_a_record_error_naming_the_folder(tmp_path: Path) -> None:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    folder = spools.folder
    assert folder is not None
    (folder / "1-body.json").mkdir()  # the body's path is taken by a folder
    with pytest.raises(RecordError) as caught:
        spools.write_body("env", threading.Event())
    assert str(caught.value) == (
        f"cannot read or write the aggregation spool in {folder}: [Errno 21] Is a directory: "
        f"'{folder / '1-body.json'}'; free space or fix permissions there (it sits beside the metrics "
        "file), then run `gym-ray aggregate RUN_DIR CONFIG` again"
    )
    spools.remove()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_stop_set_before_the_body_is_written_stops_at_the_first_row(tmp_path: Path, rows: int) -> None:
    spools = _spools(tmp_path, [((i, 0), {"i": i}) for i in range(rows)])
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        spools.write_body("env", stop)
    spools.remove()


def test_a_stop_set_while_the_body_is_written_is_seen_at_the_next_check(tmp_path: Path) -> None:
    spools = _spools(tmp_path, [((i, 0), {"i": i}) for i in range(STOP_CHECK_ROWS + 1)])
    stop = _StopAfterFirstLook()
    with pytest.raises(Stopped):
        spools.write_body("env", stop)
    assert stop.looks == 2  # row 0, then row STOP_CHECK_ROWS
    spools.remove()


def _read(tmp_path: Path, reply: str, stop: threading.Event | None = None) -> Any:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    spools.write_body("env", threading.Event())
    spools.reply_path("env").write_text(reply, encoding="utf-8")
    keep = ("group_level_metrics", "key_metrics")
    return spools.read_reply("env", stop or threading.Event(), keep=keep, what="the reply", hint="fix it")


def test_a_stop_set_before_a_reply_is_read_stops_at_its_first_element(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        _read(tmp_path, '{"group_level_metrics": [{"a": 1}]}', stop)


def test_a_stop_set_while_a_reply_is_read_is_seen_at_the_next_check(tmp_path: Path) -> None:
    elements = ",".join(['{"a": 1}'] * (STOP_CHECK_ROWS + 1))
    stop = _StopAfterFirstLook()
    with pytest.raises(Stopped):
        _read(tmp_path, '{"group_level_metrics": [' + elements + "]}", stop)
    assert stop.looks == 2


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        pytest.param(
            '{"group_level_metrics": [{}, {}, {"x": NaN}]}',
            "the reply whose group_level_metrics[2] is not strict JSON (Out of range float values are not "
            "JSON compliant: nan); fix it",
            id="third-element-not-finite",
        ),
        pytest.param(
            '{"group_level_metrics": [{"a": 1}], "group_level_metrics": [{"b": 2}]}',
            "the reply that names 'group_level_metrics' twice; fix it",
            id="streamed-key-twice-with-elements",
        ),
    ],
)
def test_a_bad_reply_is_named_exactly(tmp_path: Path, reply: str, message: str) -> None:
    with pytest.raises(ServerResponseError) as caught:
        _read(tmp_path, reply)
    assert str(caught.value) == message
    assert caught.value.body_excerpt == reply


# --- grouping: order of rows without identity, the problems listed ------------------------------------


def _topology() -> Topology:
    return Topology.from_config(_base_config())


def _stamped(value: int, **identity: Any) -> dict[str, Any]:
    return {
        "reward": float(value),
        "_ng_environment_server": "env_a",
        "agent_ref": {"name": "ag1"},
        **identity,
    }


def test_a_row_without_integer_indices_sorts_as_task_0_rollout_0(tmp_path: Path) -> None:
    rows = [
        _stamped(0, _ng_task_index=1, _ng_rollout_index=0),
        _stamped(1, _ng_task_index=0, _ng_rollout_index=1),
        _stamped(2),  # no indices at all: key (0, 0)
        _stamped(3, _ng_task_index="0", _ng_rollout_index=None),  # not integers: key (0, 0), after row 2
    ]
    spools = ServerSpools(tmp_path)
    grouping = group_results(rows, _topology(), spools, threading.Event())
    assert (grouping.counts, grouping.first_agent, grouping.errors) == ({"env_a": 4}, {"env_a": "ag1"}, {})
    body = spools.write_body("env_a", threading.Event())
    assert body.read_bytes() == _compact([rows[2], rows[3], rows[1], rows[0]])
    spools.remove()


def test_every_unknown_stamp_is_named_with_its_first_row(tmp_path: Path) -> None:
    rows = [
        _stamped(0, _ng_task_index=0, _ng_rollout_index=0),
        {**_stamped(1, _ng_task_index=0, _ng_rollout_index=1), "_ng_environment_server": "env_x"},
        {**_stamped(2, _ng_task_index=1, _ng_rollout_index=0), "_ng_environment_server": 7},
        {**_stamped(3, _ng_task_index=2, _ng_rollout_index=0), "_ng_environment_server": "env_x"},
    ]
    spools = ServerSpools(tmp_path)
    with pytest.raises(ValidationError) as caught:
        group_results(rows, _topology(), spools, threading.Event())
    assert str(caught.value) == (
        "Result rows are stamped with environment server 'env_x', '7', which is not in the running config "
        "(available: ['env_a', 'env_b', 'env_c', 'env_multi']); aggregate with the config that produced them "
        "('env_x' first at result #1 (task 0, rollout 1); '7' first at result #2 (task 1, rollout 0))"
    )
    assert caught.value.problems == [
        "result #1 (task 0, rollout 1): _ng_environment_server='env_x'",
        "result #2 (task 1, rollout 0): _ng_environment_server='7'",
    ]
    spools.remove()


@pytest.mark.parametrize("extra", [0, 2])
def test_unattributable_rows_are_listed_up_to_the_limit_and_counted(tmp_path: Path, extra: int) -> None:
    topology = _topology()
    with pytest.raises(GymRayError) as reason:
        topology.front_of("ag1")
    n = MAX_LISTED_ROWS + extra
    rows = [
        {"reward": 1.0, "agent_ref": {"name": "ag1"}, "_ng_task_index": i, "_ng_rollout_index": 0}
        for i in range(n)
    ]
    spools = ServerSpools(tmp_path)
    with pytest.raises(ValidationError) as caught:
        group_results(rows, topology, spools, threading.Event())
    listed = [f"result #{i} (task {i}, rollout 0): {reason.value}" for i in range(MAX_LISTED_ROWS)]
    assert str(caught.value) == (
        f"{n} result row(s) have no _ng_environment_server stamp and cannot be attributed to an environment "
        "server; aggregate results recorded by gym_ray (they carry the stamp), or give the rows "
        "agent_ref.name: " + " | ".join(listed) + (f" | ... and {extra} more" if extra else "")
    )
    assert caught.value.problems == listed
    spools.remove()


# --- write errors on a full device (/dev/full: every flush fails with ENOSPC) ----------------------------


def _full_spool(tmp_path: Path) -> tuple[ServerSpools, Path]:
    """Spools whose second server's spool file is a link to /dev/full."""
    spools = ServerSpools(tmp_path)
    spools.add("first", (0, 0), {"a": 1})
    folder = spools.folder
    assert folder is not None
    (folder / "2-spool.jsonl").symlink_to("/dev/full")
    return spools, folder


def _spool_error(folder: Path, action: str, detail: str) -> str:
    return (
        f"cannot {action} the aggregation spool in {folder}: {detail}; free space or fix permissions there "
        "(it sits beside the metrics file), then run `gym-ray aggregate RUN_DIR CONFIG` again"
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail)")
def test_a_spool_that_cannot_be_flushed_is_a_record_error(tmp_path: Path) -> None:
    spools, folder = _full_spool(tmp_path)
    spools.add("second", (0, 0), {"b": 2})  # buffered: the failure shows when the spool is closed
    with pytest.raises(RecordError) as caught:
        spools.finish()
    assert str(caught.value) == _spool_error(folder, "write", "[Errno 28] No space left on device")
    spools.remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail)")
def test_a_spool_line_that_cannot_be_written_is_a_record_error(tmp_path: Path) -> None:
    spools, folder = _full_spool(tmp_path)
    with pytest.raises(RecordError) as caught:
        spools.add("second", (0, 0), {"b": "x" * (2 << 20)})  # larger than the buffer: written at once
    assert str(caught.value) == _spool_error(folder, "write", "[Errno 28] No space left on device")
    spools.remove()
    assert os.listdir(tmp_path) == []


def test_a_missing_reply_file_is_a_record_error(tmp_path: Path) -> None:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    spools.write_body("env", threading.Event())
    folder = spools.folder
    assert folder is not None
    with pytest.raises(RecordError) as caught:
        spools.read_reply("env", threading.Event(), keep=(), what="w", hint="h")
    detail = f"[Errno 2] No such file or directory: '{folder / '1-reply.json'}'"
    assert str(caught.value) == _spool_error(folder, "read or write", detail)
    spools.remove()


def test_the_reply_excerpt_is_its_first_bytes_with_bad_utf8_replaced(tmp_path: Path) -> None:
    members = ",".join(f'"k{i}": {i}' for i in range(EXCERPT_BYTES))
    text = '{"note": "\xff", ' + members + "}"
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    spools.write_body("env", threading.Event())
    spools.reply_path("env").write_bytes(text.encode("latin-1"))  # \xff alone is not UTF-8
    with pytest.raises(ServerResponseError) as caught:
        spools.read_reply("env", threading.Event(), keep=(), what="w", hint="h")
    assert caught.value.body_excerpt == text[:EXCERPT_BYTES].replace("\xff", "\ufffd")
    spools.remove()


# --- the metrics file: shape of edge cases, chunked writing ----------------------------------------------


def test_the_metrics_file_of_empty_entries_in_a_new_nested_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "m.json"
    entries: list[dict[str, Any]] = [{}, {"x": []}, {}]
    write_metrics_atomic(path, entries, threading.Event())
    assert path.read_text() == json.dumps(entries, indent=2, ensure_ascii=False)
    assert path.read_text() == '[\n  {},\n  {\n    "x": []\n  },\n  {}\n]'


class _CountingStop(threading.Event):
    """A stop event never set, which counts how often the writer looks at it (once per chunk written)."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return super().is_set()


def test_the_metrics_file_is_written_in_chunks_of_about_a_mebibyte(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    # nine members of 300,002 characters: a chunk is flushed once 4 are pending (1.2 MB), then at the end
    entries = [{f"k{i}": "x" * 300_000 for i in range(9)}]
    stop = _CountingStop()
    write_metrics_atomic(path, entries, stop)
    assert path.read_text() == json.dumps(entries, indent=2)
    assert stop.looks == 3  # after members 4 and 8, and the last flush


def test_a_fragment_is_copied_in_chunks_of_a_mebibyte(tmp_path: Path) -> None:
    elements = [{"i": i, "text": "y" * 1000} for i in range(2500)]
    fragment = tmp_path / "f.part"
    fragment.write_text(
        ",\n".join("      " + json.dumps(e, indent=2).replace("\n", "\n      ") for e in elements)
    )
    chunks = -(-fragment.stat().st_size // (1 << 20))
    assert chunks == 3
    path = tmp_path / "m.json"
    stop = _CountingStop()
    write_metrics_atomic(path, [{"group_level_metrics": Fragment(fragment, len(elements)), "n": 1}], stop)
    assert path.read_text() == json.dumps([{"group_level_metrics": elements, "n": 1}], indent=2)
    assert stop.looks == 1 + chunks + 1  # the flush before the copy, each chunk, the last flush


def test_only_persisted_successes_are_grouped(tmp_path: Path) -> None:
    rows = [
        _stamped(0, _ng_task_index=0, _ng_rollout_index=0, _ng_no_persist=True),  # omitted, no failure class
        _stamped(1, _ng_task_index=1, _ng_rollout_index=0, _ng_failure_class="agent_run_error"),
        _stamped(2, _ng_task_index=2, _ng_rollout_index=0, _ng_failure_class=""),  # a class, even empty
        _stamped(3, _ng_task_index=3, _ng_rollout_index=0, _ng_no_persist=False, _ng_failure_class=None),
    ]
    spools = ServerSpools(tmp_path / "new" / "folder")  # created, parents included, on the first line
    grouping = group_results(rows, _topology(), spools, threading.Event())
    assert grouping.counts == {"env_a": 1}
    assert spools.write_body("env_a", threading.Event()).read_bytes() == _compact([rows[3]])
    spools.remove()
    assert os.listdir(tmp_path / "new" / "folder") == []


def test_adding_after_finish_is_an_internal_error_naming_the_server(tmp_path: Path) -> None:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    with pytest.raises(InternalError) as caught:
        spools.add("env", (0, 1), {"a": 2})
    assert str(caught.value) == "aggregation spool of 'env': add() after finish()"
    spools.remove()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail)")
def test_remove_logs_a_spool_it_cannot_close_and_still_removes_the_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spools, folder = _full_spool(tmp_path)
    spools.add("second", (0, 0), {"b": 2})  # buffered: closing it fails
    with caplog.at_level(logging.WARNING, logger="gym_ray.finalize.aggregate"):
        spools.remove()
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "gym_ray.finalize.aggregate",
            logging.WARNING,
            f"cannot close the aggregation spool {folder / '2-spool.jsonl'}",
        )
    ]
    exc_info = caplog.records[0].exc_info
    assert exc_info is not None
    assert isinstance(exc_info[1], OSError)
    assert exc_info[1].errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
    assert spools.folder is None
    spools.remove()  # a second remove has nothing left to do
    assert len(caplog.records) == 1


def test_remove_logs_a_folder_it_cannot_delete(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spools = _spools(tmp_path, [((0, 0), {"a": 1})])
    folder = spools.folder
    assert folder is not None
    folder.rename(tmp_path / "moved")
    folder.symlink_to(tmp_path / "moved")  # rmtree refuses a symbolic link (even for root)
    with caplog.at_level(logging.WARNING, logger="gym_ray.finalize.aggregate"):
        spools.remove()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"cannot remove the aggregation spool folder {folder}")
    ]
    exc_info = caplog.records[0].exc_info
    assert exc_info is not None
    assert isinstance(exc_info[1], OSError)
    assert spools.folder is None


def test_a_spool_folder_that_cannot_be_created_names_its_parent(tmp_path: Path) -> None:
    parent = tmp_path / "taken"
    parent.write_text("a file, not a folder")
    spools = ServerSpools(parent)
    with pytest.raises(RecordError) as caught:
        spools.add("env", (0, 0), {"a": 1})
    assert str(caught.value) == _spool_error(parent, "write", f"[Errno 17] File exists: '{parent}'")
    assert spools.folder is None


def test_a_row_that_cannot_be_encoded_drops_its_servers_spool_at_once(tmp_path: Path) -> None:
    rows = [
        _stamped(0, _ng_task_index=0, _ng_rollout_index=0),
        {**_stamped(1, _ng_task_index=0, _ng_rollout_index=1), "_ng_environment_server": "env_b"},
        _stamped(2, _ng_task_index=1, _ng_rollout_index=0, blob={1, 2}),  # a set is not JSON
        _stamped(3, _ng_task_index=2, _ng_rollout_index=0),
    ]
    spools = ServerSpools(tmp_path)
    grouping = group_results(rows, _topology(), spools, threading.Event())
    assert grouping.counts == {"env_a": 3, "env_b": 1}
    assert list(grouping.errors) == ["env_a"]
    folder = spools.folder
    assert folder is not None
    assert os.listdir(folder) == ["2-spool.jsonl"]  # env_a's spool (1) is gone, env_b's stays
    spools.remove()


def test_an_unstamped_row_goes_to_its_agents_front_even_in_legacy_mode(tmp_path: Path) -> None:
    # aggregate_metrics' contract: a result without a stamp is attributed to the server fronting its agent
    cfg = {**_base_config(), "environment_routing_mode": "legacy", "environment_server_name": "env_a"}
    rows = [{"reward": 1.0, "agent_ref": {"name": "ag2"}, "_ng_task_index": 0, "_ng_rollout_index": 0}]
    spools = ServerSpools(tmp_path)
    grouping = group_results(rows, Topology.from_config(cfg), spools, threading.Event())
    assert (grouping.counts, grouping.first_agent) == ({"env_c": 1}, {"env_c": "ag2"})
    spools.remove()


def test_without_environment_servers_an_agent_is_its_own_server(tmp_path: Path) -> None:
    topology = Topology.from_config({"ag1": _agent("ag1"), "ag2": _agent("ag2")})
    rows = [
        {"reward": 1.0, "_ng_environment_server": "ag2", "_ng_task_index": 0, "_ng_rollout_index": 0},
        {"reward": 0.0, "agent_ref": {"name": "ag1"}, "_ng_task_index": 1, "_ng_rollout_index": 0},
    ]
    spools = ServerSpools(tmp_path)
    grouping = group_results(rows, topology, spools, threading.Event())
    assert (grouping.counts, grouping.first_agent) == ({"ag2": 1, "ag1": 1}, {"ag2": None, "ag1": "ag1"})
    spools.remove()


async def test_a_cancelled_caller_retrieves_the_works_exception(tmp_path: Path) -> None:
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    started = threading.Event()

    def work(stop: threading.Event) -> None:
        started.set()
        if stop.wait(60):
            raise Stopped

    try:
        task = asyncio.create_task(run_joined(work))
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []  # no "Future exception was never retrieved"

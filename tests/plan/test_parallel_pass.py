"""Planning's validation pass over byte ranges in spawned processes plans exactly what the one-process pass
plans (shard files, manifests), and refuses a bad row with exactly its error (the file's own line)."""

from __future__ import annotations

import itertools
import json
import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import GymRayError
from gym_ray.plan import _parallel_pass
from gym_ray.plan._parallel_pass import split_ranges, valid_ranges
from gym_ray.plan._spill_dedupe import RangeRecorder, SpillDedupe
from gym_ray.plan._validate_pass import RowsInvalid, count_valid_rows
from gym_ray.plan.first_pass import adopt_parts
from gym_ray.plan.load import load_jsonl
from gym_ray.plan.shards import prepare_run
from gym_ray.servers import load_bundled_config
from tests.main_script import run_as_main_script
from tests.plan.test_common_rows import _config, _row
from tests.plan.test_valid_lines import _planned


def _adopted_ranges(run: RunConfig, dedupe: SpillDedupe) -> int | None:
    """The parallel pass's parts, adopted by ``dedupe`` in order: the rows planned (None: not applicable)."""
    parts = valid_ranges(run.settings, run.topology, dedupe.folder)
    if parts is None:
        return None
    adopt_parts(dedupe, (part for _count, part in parts))
    return sum(count for count, _part in parts)


def _varied_rows() -> list[Any]:
    """Common rows mixed with shapes the common path hands to the general path, some repeated."""
    return [
        _row("q0", meta={"b": 1, "a": [1.5, "é"]}),
        _row("q1", agent="arith_agent_hard"),
        _row("q2", note=None),  # a null: the digest takes json's form
        _row("q3", big=2**70),  # past 64 bits: json reads it
        _row("q4", _ng_task_index=7),  # the caller's task index is kept
        {"responses_create_params": {"input": "q5"}, "task_source": "arith_agent"},  # agent by task_source
        {"responses_create_params": {"input": "q6"}, "_ng_environment_server": "arith_env"},  # stamped
        {"task_id": {"taskset": "arith", "task_id": "t1"}, "task_input": {"x": 1}},  # materialized
        _row("q7", task_id="plain"),
    ]


def _write(path: Path, lines: list[str], *, newline: str = "\n", last_newline: bool = True) -> None:
    data = newline.join(lines) + (newline if last_newline else "")
    path.write_bytes(data.encode("utf-8"))


def _lines(copies: int) -> list[str]:
    """``copies`` rounds of the varied rows plus distinct rows: identical rows in every range."""
    out = []
    for i in range(copies):
        out.extend(json.dumps(r, ensure_ascii=False) for r in _varied_rows())
        out.extend(json.dumps(_row(f"d{i}-{j}")) for j in range(3))
    return out


@pytest.mark.parametrize(
    ("processes", "newline", "last_newline", "bom"),
    [
        pytest.param(2, "\n", True, False, id="two-ranges"),
        pytest.param(3, "\r\n", False, True, id="three-ranges-crlf-bom-no-final-newline"),
    ],
)
def test_ranges_in_processes_plan_what_one_process_plans_byte_for_byte(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    processes: int,
    newline: str,
    last_newline: bool,
    bom: bool,
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(6)
    if bom:
        lines[0] = "\ufeff" + lines[0]
    _write(input_path, lines, newline=newline, last_newline=last_newline)
    one = _planned(tmp_path, "one", input_path, num_repeats=2, shard_size=5)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", processes)
    run = _config(tmp_path, "unused", input_path, num_repeats=2)
    assert len(split_ranges(str(input_path), processes)) == processes
    with SpillDedupe() as dedupe, SpillDedupe() as serial:  # the ranges really run in processes
        assert _adopted_ranges(run, dedupe) == len(lines) * 2
        rows = load_jsonl(input_path)
        assert count_valid_rows(rows, run.settings, run.topology, serial) == len(lines) * 2
        assert dedupe.lookups == serial.lookups == 6 * 11  # every row numbered by content but `q4`
    assert _planned(tmp_path, "ranges", input_path, num_repeats=2, shard_size=5) == one


@pytest.mark.parametrize(
    ("bad_line", "fragment"),
    [
        pytest.param('{"responses_create_params": {', "line 56: malformed JSON", id="json"),
        pytest.param("", "line 56: blank line", id="blank"),
        pytest.param(
            json.dumps(_row("q", agent="arith_agnet")),
            "line 56: unknown agent: 'arith_agnet' is not in the running config (did you mean "
            "'arith_agent'?); ",
            id="agent",
        ),
        pytest.param(
            json.dumps(_row("q", _ng_task_index=-1)),
            "line 56: the row's _ng_task_index must be an integer >= 0",
            id="task-index",
        ),
    ],
)
def test_a_bad_row_in_the_second_range_is_refused_with_the_one_process_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_line: str, fragment: str
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(5)
    _write(input_path, [*lines[:55], bad_line, *lines[55:]])
    _first, second = split_ranges(str(input_path), 2)
    assert input_path.read_bytes()[: second[0]].count(b"\n") < 55  # line 56 is in the second range
    with pytest.raises(GymRayError) as caught:
        prepare_run(_config(tmp_path, "one", input_path))
    expected = str(caught.value)
    assert fragment in expected
    monkeypatch.setattr(_parallel_pass, "PROCESSES", 2)
    run = _config(tmp_path, "ranges", input_path)
    with SpillDedupe() as dedupe, pytest.raises(RowsInvalid, match="bytes "):  # found by the child
        _adopted_ranges(run, dedupe)
    with pytest.raises(type(caught.value)) as again:
        prepare_run(run)
    assert str(again.value) == expected
    assert not (tmp_path / "ranges").exists()  # nothing written


def test_a_file_with_fewer_lines_than_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = [json.dumps(_row("a")), json.dumps(_row("b")), json.dumps(_row("a"))]
    _write(input_path, lines)
    one = _planned(tmp_path, "one", input_path, shard_size=1)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", 5)
    sizes = [len(line) + 1 for line in lines]
    assert split_ranges(str(input_path), 5) == [
        (0, sizes[0]),
        (sizes[0], sum(sizes[:2])),
        (sum(sizes[:2]), sum(sizes)),
    ]
    assert _planned(tmp_path, "ranges", input_path, shard_size=1) == one
    single = tmp_path / "single.jsonl"
    _write(single, lines[:1])
    run = _config(tmp_path, "single", single)
    with SpillDedupe() as dedupe:
        assert _adopted_ranges(run, dedupe) is None  # one range: one process
        assert dedupe.lookups == 0


def test_ranges_are_cut_just_after_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"aaa\n" * 4)
    assert split_ranges(str(path), 2) == [(0, 8), (8, 16)]  # byte 8 is just after a newline: kept
    assert split_ranges(str(path), 3) == [(0, 8), (8, 12), (12, 16)]
    path.write_bytes(b"aaa\naaa")  # no final newline
    assert split_ranges(str(path), 2) == [(0, 4), (4, 7)]
    path.write_bytes(b"a" * 10 + b"\n" + b"b\n")  # a long line swallows two cuts
    assert split_ranges(str(path), 4) == [(0, 11), (11, 13)]
    path.write_bytes(b"")
    assert split_ranges(str(path), 2) == []


def test_the_dedupe_adopts_parts_recorded_apart_as_one_lookup_each() -> None:
    keys = [5, 2**64 - 1, 5, 7, 0, 7, 5, 2**63] * 300
    with SpillDedupe(chunk=97) as one, SpillDedupe(chunk=97) as parts:
        for key in keys:
            one.add(key)
        for name, part in (("a", keys[:1000]), ("b", keys[1000:1001]), ("c", keys[1001:])):
            recorder = RangeRecorder(parts.folder, name, chunk=89)
            assert [recorder.add(key) for key in part] == list(range(len(part)))  # the part's own ordinals
            parts.adopt_range(*recorder.finish())
        assert parts.lookups == one.lookups == len(keys)
        replays = one.replay(), parts.replay()
        assert [replays[0].add(k) for k in keys] == [replays[1].add(k) for k in keys]
        for replay in replays:
            replay.finish()  # the same sequence digest


def test_a_bad_row_in_the_first_range_stops_the_pass_and_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(5)
    _write(input_path, [*lines[:2], json.dumps(_row("q", agent="arith_agnet")), *lines[2:]])
    with pytest.raises(GymRayError) as caught:
        prepare_run(_config(tmp_path, "one", input_path))
    assert (
        "line 3: unknown agent: 'arith_agnet' is not in the running config (did you mean 'arith_agent'?); "
        in (str(caught.value))
    )
    monkeypatch.setattr(_parallel_pass, "PROCESSES", 2)
    run = _config(tmp_path, "ranges", input_path)
    with SpillDedupe() as dedupe, pytest.raises(RowsInvalid, match="row 2"):  # found here, child terminated
        _adopted_ranges(run, dedupe)
    assert dedupe.lookups == 0  # nothing handed over
    with pytest.raises(type(caught.value)) as again:
        prepare_run(run)
    assert str(again.value) == str(caught.value)
    assert not (tmp_path / "ranges").exists()


def _count_in_daemon(conn: Connection, input_path: str, output_dir: str) -> None:
    """Body of a daemon process (which may not start processes): the forced parallel pass's outcome."""
    _parallel_pass.PROCESSES = 2
    run = RunConfig.from_dict(
        {**load_bundled_config(), "input_jsonl_fpath": input_path, "output_dir": output_dir}
    )
    with SpillDedupe() as dedupe:
        conn.send((_adopted_ranges(run, dedupe), dedupe.lookups))
    conn.close()


def test_a_daemon_process_validates_in_one_process(tmp_path: Path) -> None:
    input_path = tmp_path / "rows.jsonl"
    _write(input_path, [json.dumps(_row(f"q{i}")) for i in range(20)])
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_count_in_daemon, args=(sender, str(input_path), str(tmp_path / "run")), daemon=True
    )
    proc.start()
    sender.close()
    try:
        assert receiver.poll(120)
        assert receiver.recv() == (None, 0)  # not applicable there: the caller's one-process pass runs
    finally:
        proc.join(120)
        receiver.close()
    assert proc.exitcode == 0


RANGE_SCRIPT = """
if __name__ == "__main__":
    import json, sys
    from pathlib import Path
    from gym_ray.plan import _parallel_pass
    from gym_ray.plan._spill_dedupe import SpillDedupe
    from tests.plan.test_common_rows import _config
    from tests.plan.test_parallel_pass import _adopted_ranges
    _parallel_pass.PROCESSES = 2
    folder = Path(sys.argv[1])
    run = _config(folder, "run", folder / "rows.jsonl")
    with SpillDedupe() as dedupe:
        print(json.dumps({"rows": _adopted_ranges(run, dedupe), "pid": os.getpid()}))
"""


def test_the_range_process_does_not_run_the_main_script_again(tmp_path: Path) -> None:
    # A real script as __main__ whose top level notes each pid that runs it (tests/main_script.py): in a
    # Ray actor that script is Ray's default_worker.py, which would import Ray again (gym_ray._spawn).
    _write(tmp_path / "rows.jsonl", _lines(2))
    report, pids = run_as_main_script(tmp_path, RANGE_SCRIPT, str(tmp_path))
    assert report["rows"] == len(_lines(2))  # validated over two byte ranges, one in a spawned process
    assert pids == [report["pid"]]


@pytest.mark.parametrize(
    ("cpus", "file_ranges", "expected"),
    [
        (2, 40, 2),  # this machine: both CPUs
        (64, 40, 16),  # a large machine: MAX_PROCESSES
        (64, 5, 5),  # a large machine, a smaller file: one process per MIN_RANGE_BYTES
        (8, 1, 0),  # under MIN_PARALLEL_BYTES: one process
        (1, 40, 0),  # one CPU: one process
    ],
)
def test_the_pass_takes_one_process_per_cpu_bounded_by_the_cap_and_the_file_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, file_ranges: int, expected: int
) -> None:
    # sizes scaled down (a range's worth of bytes is 1 KiB here); the CPU count is the only thing faked
    monkeypatch.setattr(_parallel_pass, "MIN_RANGE_BYTES", 1024)
    monkeypatch.setattr(_parallel_pass, "MIN_PARALLEL_BYTES", 2048)
    monkeypatch.setattr(_parallel_pass, "_usable_cpus", lambda: cpus)
    input_path = tmp_path / "rows.jsonl"
    lines: list[str] = []
    while sum(len(line) + 1 for line in lines) < file_ranges * 1024 + 512:
        lines.append(json.dumps(_row(f"q{len(lines)}")))
    _write(input_path, lines)
    run = _config(tmp_path, "unused", input_path)
    ranges = _parallel_pass._planned_ranges(run.settings, run.topology)
    assert len(ranges) == expected
    if ranges:
        assert ranges[0][0] == 0
        assert ranges[-1][1] == input_path.stat().st_size
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(ranges))

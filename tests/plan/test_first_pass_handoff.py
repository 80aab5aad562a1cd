"""The validation pass run ahead of Ray (``validate_ahead``) and handed to the planner: the same shards
byte for byte as a planner that validates itself, taken at most once, refused (and the pass run again)
when the input changed or the folder is elsewhere; a bad row is refused by ``validate_ahead`` with the
planner's exact message and leaves nothing behind. Real files, no Ray."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gym_ray.errors import GymRayError, ValidationError
from gym_ray.plan import _parallel_pass, first_pass, shards
from gym_ray.plan.first_pass import CheckedInput, validate_ahead
from gym_ray.plan.shards import iter_prepare_run, prepare_run
from tests.plan.test_common_rows import _config, _row
from tests.plan.test_parallel_pass import _lines, _planned, _write


def _owned_folders() -> set[str]:
    """This process's validation folders in the temporary folder."""
    tag = f"gym_ray-dedupe-{os.getpid()}@"
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(tag)}


def _no_first_pass(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the planner ran the validation pass again")


def _plan_bytes(run_dir: Path, specs: list[Any]) -> list[bytes]:
    return [(run_dir / f"rollouts-{s.shard}_materialized_inputs.jsonl").read_bytes() for s in specs]


@pytest.mark.parametrize("processes", [None, 2], ids=["one-process", "two-ranges"])
def test_a_taken_pass_plans_what_a_planner_validating_itself_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int | None
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(6)
    _write(input_path, lines)
    expected = _planned(tmp_path, "self", input_path, num_repeats=2, shard_size=5)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", processes)
    before = _owned_folders()
    run = _config(tmp_path, "taken", input_path, num_repeats=2, shard_size=5)
    checked = validate_ahead(run)
    assert checked.rows == len(lines) * 2
    assert checked.folder is not None
    assert Path(checked.folder).is_dir()
    assert len(checked.parts) == (processes or 1)
    monkeypatch.setattr(shards, "first_pass", _no_first_pass)  # the planner must not read it again
    specs = list(iter_prepare_run(run, checked=checked))
    assert not Path(checked.folder).exists()  # taken, and removed with the planner's dedupe
    assert specs[-1].run_rows == len(lines) * 2
    monkeypatch.setattr(shards, "first_pass", first_pass.first_pass)
    assert _planned(tmp_path, "taken", input_path, num_repeats=2, shard_size=5) == expected  # its bytes
    checked.discard()  # nothing left to remove: no error
    assert _owned_folders() == before


def test_a_pass_is_taken_at_most_once_and_the_second_planner_validates_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    input_path = tmp_path / "rows.jsonl"
    _write(input_path, _lines(3))
    run = _config(tmp_path, "run", input_path, shard_size=4)
    checked = validate_ahead(run)
    first = list(iter_prepare_run(run, checked=checked))
    calls: list[int] = []
    real = first_pass.first_pass

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(shards, "first_pass", counting)
    again = list(iter_prepare_run(run, checked=checked))  # a restarted driver: the folder is gone
    assert calls == [1]
    assert again == first  # the same run id and shards (a resume of its own plan)


@pytest.mark.parametrize("why", ["input-changed", "other-host"])
def test_a_pass_that_does_not_fit_is_left_and_the_planner_validates_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(3)
    _write(input_path, lines)
    run = _config(tmp_path, "run", input_path, shard_size=4)
    checked = validate_ahead(run)
    assert checked.folder is not None
    if why == "input-changed":
        _write(input_path, [*lines, json.dumps(_row("one more"))])  # planned as it is now: 37 rows
    else:
        checked = CheckedInput(checked.rows, "elsewhere", checked.folder, checked.parts, checked.source)
    specs = list(iter_prepare_run(run, checked=checked))
    assert specs[-1].run_rows == len(lines) + (1 if why == "input-changed" else 0)
    assert Path(checked.folder).is_dir()  # not taken: the caller discards it
    checked.discard()
    assert not Path(checked.folder).exists()


def test_a_bad_row_is_refused_ahead_with_the_planners_message_and_nothing_left(tmp_path: Path) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = _lines(2)
    _write(input_path, [*lines[:3], json.dumps(_row("q", agent="arith_agnet")), *lines[3:]])
    with pytest.raises(ValidationError) as planned:
        prepare_run(_config(tmp_path, "planned", input_path))
    before = _owned_folders()
    run = _config(tmp_path, "ahead", input_path)
    with pytest.raises(ValidationError) as ahead:
        validate_ahead(run)
    assert str(ahead.value) == str(planned.value)
    # one line, the row named by its line in the file (issue 30)
    assert str(ahead.value) == (
        f"{input_path}, line 4: unknown agent: 'arith_agnet' is not in the running config (did you mean "
        "'arith_agent'?); the config's agents: arith_agent, arith_agent_hard; include the agent's config in "
        "the run or re-route the rows with agent_map"
    )
    assert _owned_folders() == before
    assert not (tmp_path / "ahead").exists()


def test_passed_rows_are_checked_ahead_and_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [_row(f"q{i % 5}") for i in range(12)]  # identical rows share a task
    expected = prepare_run(_config(tmp_path, "self", tmp_path / "unused.jsonl", shard_size=3), rows=rows)
    run = _config(tmp_path, "rows", tmp_path / "unused.jsonl", shard_size=3)
    checked = validate_ahead(run, rows)
    assert (checked.rows, checked.source) == (12, None)
    monkeypatch.setattr(shards, "first_pass", _no_first_pass)
    specs = list(iter_prepare_run(run, rows=rows, checked=checked))
    assert [(s.shard, s.num_rows) for s in specs] == [(s.shard, s.num_rows) for s in expected.shards]
    assert _plan_bytes(tmp_path / "rows", specs) == _plan_bytes(tmp_path / "self", list(expected.shards))
    bad = [*rows, {"responses_create_params": {"input": "x"}}]  # no agent
    with pytest.raises(GymRayError, match=r"row 12"):
        validate_ahead(run, bad)


def test_settings_that_number_tasks_in_memory_are_checked_ahead_without_a_folder(tmp_path: Path) -> None:
    input_path = tmp_path / "rows.jsonl"
    _write(input_path, _lines(2))
    run = _config(tmp_path, "run", input_path, num_repeats=3, interleave_repeats=True)
    checked = validate_ahead(run)
    assert (checked.rows, checked.folder, checked.parts) == (len(_lines(2)) * 3, None, ())
    assert list(iter_prepare_run(run, checked=checked))[-1].run_rows == len(_lines(2)) * 3
    bad = tmp_path / "bad.jsonl"
    _write(bad, [*_lines(1), json.dumps(_row("q", agent="arith_agnet"))])
    with pytest.raises(ValidationError, match="did you mean 'arith_agent'"):
        validate_ahead(_config(tmp_path, "bad", bad, num_repeats=3, interleave_repeats=True))

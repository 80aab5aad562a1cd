"""The validation pass's facts per line (:mod:`gym_ray.plan._line_flags`): which lines it flags, and that the
planning pass, stamping flagged lines without parsing them, plans byte for byte what it plans parsing every
line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.errors import InputError
from gym_ray.plan import _parallel_pass
from gym_ray.plan._line_flags import STAMP_AS_READ, LineFlags
from gym_ray.plan._spill_dedupe import RangeRecorder, SpillDedupe
from gym_ray.plan._valid_lines import count_valid_lines
from tests.plan.test_common_rows import _config, _row
from tests.plan.test_valid_lines import _lines, _planned, _write


def _flags_of(tmp_path: Path, lines: list[str], *, bom: bool = False, **extra: Any) -> bytes:
    path = _write(tmp_path / "rows.jsonl", lines, bom=bom)
    run = _config(tmp_path, "run", path, **extra)
    recorder = RangeRecorder(tmp_path, "whole")
    try:
        assert count_valid_lines(run.settings, run.topology, recorder) is not None
        part = recorder.finish()
    finally:
        recorder.close()
    return part.digests.with_suffix(".flags").read_bytes()


def test_a_line_is_flagged_when_it_is_json_s_text_of_a_common_row_without_indices(tmp_path: Path) -> None:
    rows = [
        _row("plain é ✓"),  # 1: compact, unicode written as is
        _row("spaced"),  # 0: written with spaces below
        _row("own task", _ng_task_index=3),  # 0: its own task index
        _row("own rollout", _ng_rollout_index=1),  # 0: its own rollout index
        _row("attempt 2", _ng_attempt_index=2),  # 0: an attempt to carry
        _row("attempt 0", _ng_attempt_index=0),  # 1
        _row("attempt x", _ng_attempt_index="x"),  # 1: not an int: attempt 0
        _row("escaped ü"),  # 0: "\u00fc" is not json's text (ensure_ascii below)
        {"responses_create_params": {"input": "by source"}, "task_source": "arith_agent"},  # 0: no agent_ref
        _row("plain é ✓"),  # 1: a repeat of the first row
    ]
    lines = [json.dumps(row, ensure_ascii=False, separators=(",", ":")) for row in rows]
    lines[1] = json.dumps(rows[1])
    lines[7] = json.dumps(rows[7], separators=(",", ":"))
    assert _flags_of(tmp_path / "a", lines) == bytes([1, 0, 0, 0, 0, 1, 1, 0, 0, 1])
    assert _flags_of(tmp_path / "b", lines, bom=True) == bytes([1, 0, 0, 0, 0, 1, 1, 0, 0, 1])
    # a compact line with a repeated key: written back it is shorter, so refused as in the general chain
    repeated = '{"responses_create_params":{"input":"r"},"agent_ref":{"name":"arith_agent"},"k":1,"k":1}'
    with pytest.raises(InputError, match="line 11: duplicate key 'k'"):
        _flags_of(tmp_path / "e", [*lines, repeated])
    flagged = bytes([1, 0, 0, 0, 0, 1, 1, 0, 0, 1])
    # "null" written as an escape: not json's text of the row, so that line is parsed; its "006e" is a
    # look-alike of an exponent inside a string, which does not stop the block's other lines
    escaped = '{"responses_create_params":{"input":"\\u006eull"},"agent_ref":{"name":"arith_agent"}}'
    assert _flags_of(tmp_path / "f", [*lines, escaped]) == flagged + bytes(1)
    # a null (a None: both encoders write it alike) does not stop the block's other lines (its own row is
    # numbered by json's form of its content, so it is parsed), nor does a hex id (its own line is flagged)
    with_null = json.dumps(_row("n", x=None), separators=(",", ":"))
    hex_id = json.dumps(_row("h", id="resp_b3737001566e6a4c16f5a5ca"), separators=(",", ":"))
    assert _flags_of(tmp_path / "c", [*lines, with_null, hex_id]) == flagged + bytes([0, 1])
    # a number json may write otherwise (an exponent): no line of the block is flagged
    assert _flags_of(
        tmp_path / "g", [*lines, json.dumps(_row("e", x=1e-05), separators=(",", ":"))]
    ) == bytes(11)
    # without strict_json the rows' digests are not taken from the duplicate-key check: nothing flagged
    assert _flags_of(tmp_path / "d", lines, strict_json=False) == bytes(10)


def _no_flags(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the planning pass parse every line; returns a list that records whether flags were offered."""
    offered: list[bool] = []
    real = SpillDedupe.line_flags

    def none(self: SpillDedupe) -> Any:
        offered.append(real(self) is not None)
        return None

    monkeypatch.setattr(SpillDedupe, "line_flags", none)
    return offered


@pytest.mark.parametrize("processes", [None, 2])
@pytest.mark.parametrize("extra", [{"num_repeats": 3, "shard_size": 4}, {"shard_size": 5}])
def test_flagged_lines_plan_byte_for_byte_what_parsed_lines_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int | None, extra: dict[str, Any]
) -> None:
    compact = [json.dumps(_row(f"c{k % 7} é"), ensure_ascii=False, separators=(",", ":")) for k in range(40)]
    others = [
        json.dumps(_row("own", _ng_task_index=2), separators=(",", ":")),
        json.dumps(_row("attempt 2", _ng_attempt_index=2), separators=(",", ":")),
        json.dumps(_row("attempt 0", _ng_attempt_index=0), separators=(",", ":")),  # flagged
        json.dumps(_row("spaced")),
        json.dumps(_row("escaped ü"), separators=(",", ":")),
        json.dumps({"responses_create_params": {"input": "s"}, "task_source": "arith_agent"}),
    ]
    path = _write(tmp_path / "rows.jsonl", [*compact, *others * 3, *compact[:9]])
    marked = _write(tmp_path / "marked.jsonl", [*compact, *_lines(), *compact[:9]])  # nothing flagged
    monkeypatch.setattr(_parallel_pass, "PROCESSES", processes)
    taken: list[int] = []
    real = LineFlags.take

    def counting(self: LineFlags, count: int) -> bytes:
        marks = real(self, count)
        taken.append(marks.count(STAMP_AS_READ))
        return marks

    monkeypatch.setattr(LineFlags, "take", counting)
    flagged = _planned(tmp_path, "flagged", path, **extra)
    assert sum(taken) == 49 + 3  # the compact lines, and the compact row with attempt 0
    flagged_marked = _planned(tmp_path, "flagged-marked", marked, **extra)
    assert sum(taken) == 49 + 3
    with monkeypatch.context() as patched:
        offered = _no_flags(patched)
        parsed = _planned(tmp_path, "parsed", path, **extra)
        parsed_marked = _planned(tmp_path, "parsed-marked", marked, **extra)
    assert offered == [True, True]
    assert flagged == parsed
    assert flagged_marked == parsed_marked


def test_the_flags_must_cover_the_lines_read_again(tmp_path: Path) -> None:
    path = tmp_path / "x.flags"
    path.write_bytes(bytes([1, 0, 1]))
    flags = LineFlags([path])
    assert flags.take(2) == bytes([1, 0])
    with pytest.raises(InputError, match="the input changed between the validation pass and the planning"):
        flags.take(2)  # more lines than the validation pass read
    flags = LineFlags([path, path])
    assert flags.take(4) == bytes([1, 0, 1, 1])
    with pytest.raises(InputError, match="the rows' contents differ"):
        flags.finish()  # fewer lines
    flags.take(2)
    flags.finish()

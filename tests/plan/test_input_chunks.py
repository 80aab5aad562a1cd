"""Planning's second pass proves from the bytes that it reads what the first pass validated.

The first pass logs a hash of every chunk it reads; the second reads the file again in the same chunks and
compares each one before parsing it, instead of taking every row's content digest again. A file edited,
grown or shrunk between the passes must still be refused, and an unchanged file must plan exactly what the
digest check plans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import InputError
from gym_ray.plan import _parallel_pass, load
from gym_ray.plan._spill_dedupe import DedupeReplay, SpillDedupe
from gym_ray.plan.preprocess import _Preprocessor
from gym_ray.plan.shards import prepare_run
from gym_ray.record.manifest import read_manifest
from gym_ray.servers import load_bundled_config

ROWS = 300
#: Small read chunks, so a 300-row file is read in many of them (the edits land inside the file).
BLOCK = 1024
CHANGED = (
    "the input changed between the validation pass and the planning pass (the rows' contents differ); "
    "do not edit the input file while a run is being planned, then run again"
)


def _line(i: int, question: str = "q") -> str:
    row = {"responses_create_params": {"input": f"{question}{i:05d}"}, "agent_ref": {"name": "arith_agent"}}
    return json.dumps(row)


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _config(tmp_path: Path, input_path: Path, **extra: Any) -> RunConfig:
    return RunConfig.from_dict(
        {
            **load_bundled_config(),
            "output_dir": str(tmp_path / "run"),
            "input_jsonl_fpath": str(input_path),
            "shard_size": 10,
            **extra,
        }
    )


def _edit_between_passes(monkeypatch: pytest.MonkeyPatch, edit: Any) -> None:
    """Run ``edit()`` once the first pass is over, just before the second starts."""
    replay = SpillDedupe.replay

    def edited(self: SpillDedupe) -> DedupeReplay:
        found = replay(self)
        edit()
        return found

    monkeypatch.setattr(SpillDedupe, "replay", edited)


def _committed(tmp_path: Path) -> set[int]:
    """The shards whose materialized inputs were moved into the run folder."""
    return {
        int(p.name.split("-")[1][:5]) for p in (tmp_path / "run").glob("rollouts-*_materialized_inputs.jsonl")
    }


@pytest.fixture(params=[1, 2], ids=["one-process", "two-ranges"])
def processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(load, "_BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(_parallel_pass, "PROCESSES", request.param)
    return int(request.param)


@pytest.mark.parametrize("row", [0, 150, ROWS - 1])
def test_a_row_edited_between_the_passes_is_refused_before_its_shard_is_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int, row: int
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = [_line(i) for i in range(ROWS)]
    _write(input_path, lines)
    edited = [*lines[:row], _line(row, "z"), *lines[row + 1 :]]  # same length, same row count, still valid
    _edit_between_passes(monkeypatch, lambda: _write(input_path, edited))
    with pytest.raises(InputError) as caught:
        prepare_run(_config(tmp_path, input_path))
    assert str(caught.value) == CHANGED
    # its chunk is compared before any of its lines is read: the shard holding the edited row never lands
    assert row // 10 not in _committed(tmp_path)
    assert _committed(tmp_path) <= set(range(row // 10))


@pytest.mark.parametrize("change", ["appended", "last line dropped", "last byte dropped"])
def test_a_file_grown_or_shrunk_between_the_passes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int, change: str
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = [_line(i) for i in range(ROWS)]
    _write(input_path, lines)
    if change == "appended":
        _edit_between_passes(monkeypatch, lambda: _write(input_path, [*lines, _line(ROWS)]))
    elif change == "last line dropped":
        _edit_between_passes(monkeypatch, lambda: _write(input_path, lines[:-1]))
    else:
        _edit_between_passes(monkeypatch, lambda: input_path.write_bytes(input_path.read_bytes()[:-1]))
    with pytest.raises(InputError) as caught:
        prepare_run(_config(tmp_path, input_path))
    assert str(caught.value) == CHANGED


def _plan_bytes(
    tmp_path: Path, name: str, input_path: Path, **extra: Any
) -> list[tuple[str, int, bytes, str]]:
    """Per shard: its label, rows, materialized inputs and the digest its manifest records."""
    plan = prepare_run(_config(tmp_path / name, input_path, **extra))
    out = []
    for spec in plan.shards:
        manifest = read_manifest(plan.run_dir, spec.shard)
        assert manifest is not None
        inputs = Path(plan.run_dir) / f"rollouts-{spec.shard}_materialized_inputs.jsonl"
        out.append((spec.shard, spec.num_rows, inputs.read_bytes(), manifest.inputs_digest))
    return out


@pytest.mark.parametrize("limit", [None, 123])
def test_an_unchanged_file_is_planned_as_the_digest_check_plans_it_with_one_digest_per_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int, limit: int | None
) -> None:
    input_path = tmp_path / "rows.jsonl"
    lines = [_line(i % 97) for i in range(ROWS)]  # duplicates: tasks numbered from the first pass
    lines[5] = lines[5].replace(",", ", ")  # other whitespace, same content as row 5 % 97
    lines[7] = json.dumps({**json.loads(lines[7]), "big": 2**70, "note": None})  # json's paths
    _write(input_path, lines)
    digests: list[str] = []  # the pass of each content digest taken in this process
    task_index, replay = _Preprocessor.task_index, SpillDedupe.replay
    passes = ["first"]

    def counted(self: _Preprocessor, row: Any) -> int:
        digests.append(passes[-1])
        return task_index(self, row)

    def second(self: SpillDedupe) -> DedupeReplay:
        passes.append("second")
        return replay(self)

    monkeypatch.setattr(_Preprocessor, "task_index", counted)
    monkeypatch.setattr(SpillDedupe, "replay", second)
    extra = {"limit": limit} if limit else {}
    proved = _plan_bytes(tmp_path, "bytes", input_path, num_repeats=2, **extra)
    rows = limit or ROWS
    assert digests.count("second") == 0  # numbered by order: the bytes are proven
    assert sum(num_rows for _shard, num_rows, _inputs, _digest in proved) == 2 * rows

    monkeypatch.setattr(SpillDedupe, "chunk_check", lambda self: None)  # the per-row digest check
    digests.clear()
    passes.append("first")
    assert _plan_bytes(tmp_path, "digests", input_path, num_repeats=2, **extra) == proved
    assert digests.count("second") == rows


def test_the_validation_pass_digests_the_sorted_text_its_duplicate_key_check_encoded(tmp_path: Path) -> None:
    input_path = tmp_path / "rows.jsonl"
    params = '"responses_create_params": {"input": "q"}'
    lines = f'{{"b": 1, {params}, "a": {{"d": [2, "é"], "c": null}}}}\n{{{params}}}\n'
    input_path.write_text(lines, encoding="utf-8")
    reader = load.load_jsonl(input_path)
    first = next(reader)
    expected = '{"a":{"c":null,"d":[2,"é"]},"b":1,"responses_create_params":{"input":"q"}}'
    assert load.sorted_text(first) == expected.encode()
    assert load.sorted_text(dict(first)) is None  # an equal row that is not the one just read
    second = next(reader)
    assert load.sorted_text(second) == b'{"responses_create_params":{"input":"q"}}'
    assert load.sorted_text(first) is None  # the last row read only
    # a block holding a run of 19 digits (json reads it) or a lenient read encodes nothing
    input_path.write_text(f'{{{params}, "n": 1234567890123456789}}\n', encoding="utf-8")
    assert load.sorted_text(next(load.load_jsonl(input_path))) is None
    input_path.write_text(f"{{{params}}}\n", encoding="utf-8")
    assert load.sorted_text(next(load.load_jsonl(input_path, strict_json=False))) is None

"""Two-pass on-disk dedupe numbers tasks exactly like the in-memory table, and planning uses it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_ray import keys
from gym_ray.config.run_config import RunConfig
from gym_ray.errors import InputError, ValidationError
from gym_ray.plan._compact_index import CompactIndex
from gym_ray.plan._spill_dedupe import SpillDedupe
from gym_ray.plan.preprocess import preprocess_examples
from gym_ray.plan.shards import iter_prepare_run
from gym_ray.record.shard_files import shard_paths


def _two_pass(keys_seen: list[int], chunk: int, tmp_path: Path) -> list[int]:
    with SpillDedupe(chunk=chunk, folder=str(tmp_path)) as dedupe:
        first = [dedupe.add(key) for key in keys_seen]
        assert first == list(range(len(keys_seen)))  # pass 1 hands out ordinals
        replay = dedupe.replay()
        numbers = [replay.add(key) for key in keys_seen]
        replay.finish()
    return numbers


@settings(max_examples=150, deadline=None)
@given(
    picks=st.lists(st.integers(0, 40), max_size=400),
    chunk=st.sampled_from([1, 3, 64, 1 << 16]),
)
def test_numbers_match_the_in_memory_table(picks: list[int], chunk: int, tmp_path_factory: Any) -> None:
    # chunk=1 with 400 lookups spills 400 runs: more than one merge round (64 files at a time).
    keys_seen = [(pick * 0x9E3779B97F4A7C15) % 2**64 for pick in picks]
    table = CompactIndex()
    expected = [table.add(key) for key in keys_seen]
    assert _two_pass(keys_seen, chunk, tmp_path_factory.mktemp("d")) == expected


@pytest.mark.parametrize("chunk", [pytest.param(2, id="spilled"), pytest.param(100, id="in-memory")])
def test_identical_rows_share_the_first_ones_number(tmp_path: Path, chunk: int) -> None:
    assert _two_pass([5, 7, 5, 9, 7, 5, 2**64 - 1, 0], chunk, tmp_path) == [0, 1, 0, 2, 1, 0, 3, 4]


def test_the_temporary_folder_holds_sorted_runs_until_closed(tmp_path: Path) -> None:
    dedupe = SpillDedupe(chunk=2, folder=str(tmp_path))
    for key in (3, 1, 2, 1, 3):
        dedupe.add(key)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["digests-000000.run", "digests-000001.run"]
    assert dedupe.lookups == 5
    dedupe.close()
    dedupe.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("second", "match"),
    [
        pytest.param(
            [1, 2, 3], r"changed between the validation pass .*\(more than 2 rows to number\)", id="longer"
        ),
        pytest.param([1], r"\(1 rows numbered, 2 validated\)", id="shorter"),
        pytest.param([1, 4], r"\(the rows' contents differ\)", id="different"),
    ],
)
def test_a_second_pass_that_differs_is_refused(tmp_path: Path, second: list[int], match: str) -> None:
    with SpillDedupe(folder=str(tmp_path)) as dedupe:
        dedupe.add(1)
        dedupe.add(2)
        replay = dedupe.replay()

        def second_pass() -> None:
            for key in second:
                replay.add(key)
            replay.finish()

        with pytest.raises(InputError, match=match):
            second_pass()


CONFIG: dict[str, Any] = {
    "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 1}}},
}


def _input(path: Path, questions: list[str], *, bad_at: int | None = None) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for index, question in enumerate(questions):
            agent = "no_such_agent" if index == bad_at else "calc_agent"
            row = {"responses_create_params": {"input": question}, "agent_ref": {"name": agent}}
            out.write(json.dumps(row) + "\n")
    return path


def _planned_identities(run_dir: Path, shards: list[str]) -> list[tuple[int, int, str]]:
    out = []
    for shard in shards:
        for line in shard_paths(run_dir, shard).materialized_inputs.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            question = row["responses_create_params"]["input"]
            out.append((row[keys.TASK_INDEX], row[keys.ROLLOUT_INDEX], question))
    return out


def test_planning_numbers_duplicate_rows_like_preprocessing(tmp_path: Path) -> None:
    questions = ["a", "b", "a", "c", "b", "a"]
    cfg = {
        **CONFIG,
        "input_jsonl_fpath": str(_input(tmp_path / "in.jsonl", questions)),
        "output_dir": str(tmp_path / "run"),
        "shard_size": 4,
        "num_repeats": 2,
    }
    specs = list(iter_prepare_run(RunConfig.from_dict(cfg)))
    planned = _planned_identities(tmp_path / "run", [s.shard for s in specs])
    assert planned == [
        (0, 0, "a"), (0, 1, "a"),
        (1, 0, "b"), (1, 1, "b"),
        (0, 2, "a"), (0, 3, "a"),
        (2, 0, "c"), (2, 1, "c"),
        (1, 2, "b"), (1, 3, "b"),
        (0, 4, "a"), (0, 5, "a"),
    ]  # fmt: skip
    in_memory = preprocess_examples(
        [{"responses_create_params": {"input": q}, "agent_ref": {"name": "calc_agent"}} for q in questions],
        num_repeats=2,
    )
    assert [(r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX]) for r in in_memory] == [p[:2] for p in planned]
    assert [s.run_rows for s in specs] == [12, 12, 12]
    assert [p.name for p in Path(cfg["output_dir"]).iterdir() if p.name.startswith("gym_ray-dedupe")] == []


def test_a_validation_error_names_the_bad_row_by_its_line_in_the_file(tmp_path: Path) -> None:
    # Row 3 repeats row 0, so the bad row 4 is task 3; the file numbers it line 5, and so does the error.
    cfg = {
        **CONFIG,
        "input_jsonl_fpath": str(_input(tmp_path / "in.jsonl", ["a", "b", "c", "a", "d"], bad_at=4)),
        "output_dir": str(tmp_path / "run"),
    }
    with pytest.raises(ValidationError, match=r"in\.jsonl, line 5: unknown agent: 'no_such_agent' "):
        next(iter_prepare_run(RunConfig.from_dict(cfg)))
    assert not (tmp_path / "run").exists()

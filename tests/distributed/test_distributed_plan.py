"""Lazy planning, as the Ray driver consumes it: validation first, then each shard committed as it is cut,
the run manifest completed at the end, resume verified shard by shard (real files in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.run_config import RunConfig
from gym_ray.errors import ResumeError, ValidationError
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.plan.shards import iter_plan, iter_prepare_run, plan_run, prepare_run
from gym_ray.record.shard_files import shard_paths

CONFIG: dict[str, Any] = {
    "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 1}}},
}


def _rows(count: int, *, tag: str = "") -> list[dict[str, Any]]:
    """Preprocessed rows: ``count`` tasks of 2 rollouts each."""
    return [
        {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, "x": f"{tag}{task}"}
        for task in range(count)
        for rollout in range(2)
    ]


def _manifest(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / RUN_MANIFEST).read_text(encoding="utf-8"))
    return data


def test_each_shard_is_on_disk_when_yielded_and_the_next_one_is_not_cut_yet(tmp_path: Path) -> None:
    specs = iter_plan(_rows(10), tmp_path, config_identity="c1", shard_size=4, run_rows=20)
    first = next(specs)
    assert (first.shard, first.num_rows, first.run_rows) == ("00000", 4, 20)
    assert shard_paths(tmp_path, "00000").materialized_inputs.exists()
    assert shard_paths(tmp_path, "00000").manifest.exists()
    assert not shard_paths(tmp_path, "00001").materialized_inputs.exists()
    assert _manifest(tmp_path)["num_shards"] is None  # written early: the run id survives a kill
    rest = list(specs)
    assert [s.shard for s in rest] == ["00001", "00002", "00003", "00004"]
    manifest = _manifest(tmp_path)
    assert (manifest["num_shards"], manifest["planned"], manifest["run_id"]) == (5, 20, first.run_id)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".staging")) == []


def test_lazy_and_whole_plans_cut_the_same_bytes(tmp_path: Path) -> None:
    whole = plan_run(_rows(9), tmp_path / "whole", config_identity="c1", shard_size=5, run_id="r1")
    lazy = list(iter_plan(_rows(9), tmp_path / "lazy", config_identity="c1", shard_size=5, run_id="r1"))
    assert [(s.shard, s.num_rows) for s in lazy] == [(s.shard, s.num_rows) for s in whole.shards]
    for spec in lazy:
        a = shard_paths(tmp_path / "whole", spec.shard).materialized_inputs.read_bytes()
        b = shard_paths(tmp_path / "lazy", spec.shard).materialized_inputs.read_bytes()
        assert a == b


def test_a_plan_stopped_midway_resumes_with_the_same_run_id_and_shards(tmp_path: Path) -> None:
    specs = iter_plan(_rows(10), tmp_path, config_identity="c1", shard_size=4)
    first, second = next(specs), next(specs)
    specs.close()  # the driver closes a planner stopped early
    again = list(iter_plan(_rows(10), tmp_path, config_identity="c1", shard_size=4))
    assert [s.shard for s in again] == ["00000", "00001", "00002", "00003", "00004"]
    assert {s.run_id for s in again} == {first.run_id}
    assert again[:2] == [first, second]
    assert _manifest(tmp_path)["num_shards"] == 5


def test_resume_verifies_each_existing_shard_by_digest_when_it_is_reached(tmp_path: Path) -> None:
    list(iter_plan(_rows(10), tmp_path, config_identity="c1", shard_size=4))
    changed = _rows(10)
    changed[-1]["x"] = "other"  # only the last shard differs
    specs = iter_plan(changed, tmp_path, config_identity="c1", shard_size=4)
    assert [next(specs).shard for _ in range(4)] == ["00000", "00001", "00002", "00003"]
    with pytest.raises(ResumeError, match=r"shard 00004 of .* was planned from other inputs"):
        next(specs)


@pytest.mark.parametrize(
    ("tasks", "match"),
    [
        pytest.param(14, "holds a run of 5 shards, but these inputs cut into more than 5", id="more-shards"),
        pytest.param(6, "holds a run of 5 shards, but these inputs cut into 3", id="fewer-shards"),
    ],
)
def test_resume_refuses_another_shard_count(tmp_path: Path, tasks: int, match: str) -> None:
    list(iter_plan(_rows(10), tmp_path, config_identity="c1", shard_size=4))
    with pytest.raises(ResumeError, match=match):
        list(iter_plan(_rows(tasks), tmp_path, config_identity="c1", shard_size=4))


def test_resume_refuses_another_config_identity_before_cutting(tmp_path: Path) -> None:
    list(iter_plan(_rows(3), tmp_path, config_identity="c1", shard_size=4))
    with pytest.raises(ResumeError, match="was collected with another configuration"):
        next(iter_plan(_rows(3), tmp_path, config_identity="c2", shard_size=4))


def _raw_rows(count: int, *, bad_at: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for index in range(count):
        agent = "no_such_agent" if index == bad_at else "calc_agent"
        rows.append({"responses_create_params": {"input": f"q{index}"}, "agent_ref": {"name": agent}})
    return rows


def test_iter_prepare_run_validates_every_row_before_writing_anything(tmp_path: Path) -> None:
    cfg = {**CONFIG, "output_dir": str(tmp_path / "run"), "shard_size": 2}
    specs = iter_prepare_run(RunConfig.from_dict(cfg), rows=_raw_rows(9, bad_at=8))
    with pytest.raises(ValidationError, match="no_such_agent"):
        next(specs)
    assert not (tmp_path / "run").exists()


def test_iter_prepare_run_counts_the_run_rows_and_matches_prepare_run(tmp_path: Path) -> None:
    cfg = {**CONFIG, "output_dir": str(tmp_path / "run"), "shard_size": 2, "num_repeats": 3}
    run = RunConfig.from_dict(cfg)
    lazy = list(iter_prepare_run(run, rows=_raw_rows(5)))
    assert [(s.shard, s.num_rows, s.run_rows) for s in lazy] == [
        ("00000", 3, 15),
        ("00001", 3, 15),
        ("00002", 3, 15),
        ("00003", 3, 15),
        ("00004", 3, 15),
    ]
    plan = prepare_run(run, rows=_raw_rows(5))  # a rerun on the same folder: resumed
    assert (plan.planned, plan.resumed, plan.run_id) == (15, True, lazy[0].run_id)
    assert plan.shards == tuple(lazy)

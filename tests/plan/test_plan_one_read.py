"""Planning from a file takes the fast path (no deep copies, orjson digests, manifests from the cut) and
gives exactly what planning the same rows from a list gives."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.plan.preprocess import iter_preprocess
from gym_ray.plan.shards import prepare_run
from gym_ray.record.manifest import ShardManifest, read_manifest
from gym_ray.servers import load_bundled_config


def _row(question: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": question}, "agent_ref": {"name": "arith_agent"}, **extra}


def test_a_plan_from_the_file_is_byte_identical_to_a_plan_from_the_same_rows(tmp_path: Path) -> None:
    rows = [
        _row("q0", meta={"b": 1, "a": [1.5, "é"]}),
        _row("q1", big=2**70),  # past 64 bits: the digest falls back to json
        _row("q0", meta={"a": [1.5, "é"], "b": 1}),  # the first row with its keys in another order
        _row("q2", note=None),
        _row("q1", big=2**70),
        _row("q3", _ng_attempt_index=2),
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines[2] = lines[2].replace(",", ", ")  # other whitespace, same content
    input_path = tmp_path / "rows.jsonl"
    input_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    base = {**load_bundled_config(), "shard_size": 2, "num_repeats": 2}
    from_file = prepare_run(
        RunConfig.from_dict({**base, "output_dir": str(tmp_path / "a"), "input_jsonl_fpath": str(input_path)})
    )
    from_rows = prepare_run(RunConfig.from_dict({**base, "output_dir": str(tmp_path / "b")}), rows=rows)
    # shard_size 2 cuts after each input row's two repeats (a task's rollouts stay together)
    assert [s.num_rows for s in from_file.shards] == [2] * 6 == [s.num_rows for s in from_rows.shards]
    for spec in from_file.shards:
        name = f"rollouts-{spec.shard}_materialized_inputs.jsonl"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # rows 2 and 4 repeat rows 0 and 1: their rollouts continue those tasks' numbering
    all_ids = [
        (r["_ng_task_index"], r["_ng_rollout_index"])
        for spec in from_file.shards
        for r in map(
            json.loads,
            (tmp_path / "a" / f"rollouts-{spec.shard}_materialized_inputs.jsonl").read_text().splitlines(),
        )
    ]
    assert all_ids == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (0, 2),
        (0, 3),
        (2, 0),
        (2, 1),
        (1, 2),
        (1, 3),
        (3, 0),
        (3, 1),
    ]
    for spec in from_file.shards:
        written = read_manifest(tmp_path / "a", spec.shard)
        other = read_manifest(tmp_path / "b", spec.shard)
        rebuilt = ShardManifest.build(
            run_id=from_file.run_id,
            shard=spec.shard,
            config_identity=from_file.config_identity,
            inputs_path=tmp_path / "a" / f"rollouts-{spec.shard}_materialized_inputs.jsonl",
        )
        assert written is not None
        assert other is not None
        assert written.model_dump(exclude={"created_at"}) == rebuilt.model_dump(exclude={"created_at"})
        assert written.model_dump(exclude={"created_at", "run_id"}) == other.model_dump(
            exclude={"created_at", "run_id"}
        )
    last = read_manifest(tmp_path / "a", "00005")
    assert last is not None
    assert last.attempt_plan == ((3, 0, 2), (3, 1, 2))


@pytest.mark.parametrize("from_json", [pytest.param(False, id="json"), pytest.param(True, id="orjson")])
def test_nan_and_null_rows_stay_apart_and_identical_rows_share_a_task(from_json: bool) -> None:
    rows = [_row("q", x=math.nan), _row("q", x=None), _row("q", x=math.nan), _row("q", x=math.inf), _row("q")]
    out = list(iter_preprocess([dict(r) for r in rows], from_json=from_json))
    assert [r["_ng_task_index"] for r in out] == [0, 1, 0, 2, 3]


def test_the_fast_path_never_mutates_its_input_rows() -> None:
    row = _row("q", agent_ref={"name": "a"})
    before = json.dumps(row, sort_keys=True)
    with pytest.warns(UserWarning, match="agent_map overrode"):
        out = list(
            iter_preprocess(
                [row], num_repeats=2, agent_map={"a": "b"}, responses_create_params={"t": 1}, from_json=True
            )
        )
    assert json.dumps(row, sort_keys=True) == before
    assert [(r["agent_ref"], r["responses_create_params"], r["_ng_rollout_index"]) for r in out] == [
        ({"name": "b"}, {"input": "q", "t": 1}, 0),
        ({"name": "b"}, {"input": "q", "t": 1}, 1),
    ]

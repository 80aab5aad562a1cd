"""A row nested deeper than orjson writes (it stops at 255 levels; json, the contract's reader and writer,
goes on): planned as json reads it, not a ``TypeError`` from inside planning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.plan.shards import prepare_run
from tests.plan.test_common_rows import _config, _row
from tests.plan.test_valid_lines import _write


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"x": 1}
    for _ in range(depth):
        value = {"d": value}
    return value


@pytest.mark.parametrize("strict_json", [True, False])
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
def test_a_row_nested_300_levels_deep_is_planned_as_json_reads_it(
    tmp_path: Path, strict_json: bool, separators: tuple[str, str]
) -> None:
    rows = [_row("deep", nested=_nested(300)), _row("plain"), _row("deep", nested=_nested(300))]
    path = _write(tmp_path / "rows.jsonl", [json.dumps(row, separators=separators) for row in rows])
    plan = prepare_run(_config(tmp_path, "run", path, strict_json=strict_json))
    planned = [
        json.loads(line)
        for spec in plan.shards
        for line in (tmp_path / "run" / f"rollouts-{spec.shard}_materialized_inputs.jsonl")
        .read_text()
        .splitlines()
    ]
    # each row as read, plus its stamps; the third row repeats the first, so it shares its task
    assert [{k: v for k, v in row.items() if not k.startswith("_ng_")} for row in planned] == rows
    assert [(row["_ng_task_index"], row["_ng_rollout_index"]) for row in planned] == [(0, 0), (1, 0), (0, 1)]

"""aggregate_run and the metrics file readers: errors that name the file, line or entry; where it writes.

Real reference servers on 127.0.0.1 (through the helpers of ``test_aggregate.py``) and real files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import InputError, ServerResponseError, UsageError
from gym_ray.finalize.aggregate import (
    aggregate_metrics,
    aggregate_run,
    completion_rejection,
    raise_for_aggregation_errors,
    read_metrics_summary,
)
from tests.finalize.test_aggregate import (
    _HOST,
    _base_config,
    _deployment,
    _failing_config,
    _failing_results,
    _Recorder,
    _result,
)


async def test_a_corrupt_line_of_the_merged_file_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good = json.dumps(_result(0, 0, 1.0, agent="ag1", server="env_a"))
    merged = run_dir / "rollouts.jsonl"
    merged.write_text(f"{good}\n{{not json\n{good}\n", encoding="utf-8")
    async with _deployment(_base_config()) as (deployment, topology, client):
        with pytest.raises(InputError) as info:
            await aggregate_run(run_dir, topology, client)
        assert deployment.stats("env_a").aggregate_calls == 0  # nothing sent from a corrupt file
    assert (info.value.path, info.value.line) == (str(merged), 2)
    assert not (run_dir / "rollouts_aggregate_metrics.json").exists()


async def test_failures_stay_in_the_file_by_default_and_output_path_is_honoured(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rollouts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _failing_results()), encoding="utf-8"
    )
    output = tmp_path / "elsewhere.json"
    async with _deployment(_failing_config()) as (_, topology, client):
        path = await aggregate_run(run_dir, topology, client, output_path=str(output))  # does not raise
    assert path == output
    assert sorted(os.listdir(run_dir)) == ["rollouts.jsonl"]  # nothing written at the default place
    written = json.loads(output.read_text(encoding="utf-8"))
    assert sorted(e["_ng_environment_server"] for e in written if "aggregation_error" in e) == [
        "env_b",
        "env_down",
    ]
    assert [e["_ng_environment_server"] for e in read_metrics_summary(output)] == [
        "env_a",
        "env_b",
        "env_c",
        "env_down",
        "env_multi",
    ]


def test_a_missing_metrics_file_is_an_input_error_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "absent.json"
    with pytest.raises(InputError) as info:
        read_metrics_summary(file)
    assert str(info.value) == (
        f"cannot read the metrics file {file}: [Errno 2] No such file or directory: '{file}'; "
        "run `gym-ray aggregate` to write it again"
    )
    assert info.value.path == str(file)


def test_a_metrics_file_that_is_not_json_is_an_input_error_naming_it_and_the_fix(tmp_path: Path) -> None:
    file = tmp_path / "m.json"
    file.write_text("these are not metrics\n", encoding="utf-8")
    with pytest.raises(InputError) as info:
        read_metrics_summary(file)
    assert f"the metrics file {file} holds text" in str(info.value)
    assert "run `gym-ray aggregate RUN_DIR CONFIG` to write it again" in str(info.value)
    assert info.value.path == str(file)


def test_an_entry_that_is_not_an_aggregate_entry_is_refused_naming_its_index() -> None:
    good = {"agent_ref": {"name": "ag1"}, "_ng_environment_server": "env_a", "agent_metrics": {}}
    with pytest.raises(InputError) as info:
        raise_for_aggregation_errors([good, {"agent_ref": {"name": "ag1"}, "agent_metrics": {}}])
    assert str(info.value) == (
        "aggregate entry #1 is not an aggregate entry: Field required at ('_ng_environment_server',)"
    )
    assert info.value.row == 1


def test_a_negative_expected_count_is_refused() -> None:
    with pytest.raises(UsageError) as info:
        completion_rejection(expected=-1, completed=0, can_retry=False, made_progress=False, strict=True)
    assert str(info.value) == (
        "completion_rejection: counts must be >= 0, got expected=-1, completed=0, final_zero_rows=0"
    )
    with pytest.raises(UsageError, match="final_zero_rows=-2"):
        completion_rejection(
            expected=1, completed=0, final_zero_rows=-2, can_retry=False, made_progress=False, strict=True
        )


def test_one_settled_rollout_with_nothing_retryable_is_accepted() -> None:
    assert (
        completion_rejection(expected=3, completed=1, can_retry=False, made_progress=True, strict=True)
        is None
    )
    assert (
        completion_rejection(
            expected=3, completed=0, final_zero_rows=1, can_retry=False, made_progress=False, strict=True
        )
        is None
    )


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        pytest.param(
            {"agent_metrics": {"x": float("nan")}, "key_metrics": {}, "group_level_metrics": []},
            "is not strict JSON (",
            id="not-finite",
        ),
        pytest.param(
            {"agent_metrics": {}, "group_level_metrics": {"x": 1}}, "is not AggregateMetrics (", id="shape"
        ),
    ],
)
async def test_a_bad_reply_raises_with_the_body_excerpt(
    tmp_path: Path, reply: dict[str, object], problem: str
) -> None:
    recorder = _Recorder(reply=lambda _: reply)
    async with recorder.serving() as port:
        cfg = {"env_rec": {"environment_servers": {"recorder": {"host": _HOST, "port": port}}}}
        topology = Topology.from_config(cfg)
        async with ServerClient(topology, connect_retries=0, max_request_retries=0) as client:
            rows = [_result(0, 0, 1.0, agent=None, server="env_rec")]
            with pytest.raises(ServerResponseError) as info:
                await aggregate_metrics(rows, topology, client, output_path=tmp_path / "m.json")
    assert str(info.value).startswith(f"/aggregate_metrics on 'env_rec' answered a body that {problem}")
    assert info.value.body_excerpt == json.dumps(reply)  # aiohttp's json_response body, short enough
    saved = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))
    assert saved[0]["aggregation_error"] == f"ServerResponseError: {info.value}"

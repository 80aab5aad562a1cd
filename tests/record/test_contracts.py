"""Recording contracts that planted bugs slipped past: ledger duplicates, stale writers, aggregation routing.

Written from RELIABILITY.md (the ledger's figures, "a second writer can never interleave lines") and
PROTOCOL.md section 2/5 (a rollout is aggregated by the environment server it ran through: its
``_ng_environment_server`` stamp, else the front of its agent). Expected figures are counted by hand from
the crafted files; the reference servers' own request counters are the oracle for routing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import ShardLockError
from gym_ray.finalize.aggregate import aggregate_metrics
from gym_ray.finalize.merge import merge_shards
from gym_ray.record.ledger import check_run
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.writer import ShardWriter
from gym_ray.servers import serve_config

# --- the ledger: duplicates are extra lines, not duplicated identities --------------------------------


def _line(task: int, rollout: int, **extra: Any) -> str:
    return json.dumps({keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, **extra}) + "\n"


def _craft(
    run_dir: Path, shard: str, inputs: list[tuple[int, int]], successes: list[tuple[int, int]]
) -> None:
    """A shard's files written by hand (PROTOCOL.md section 5 names), independent of the writer."""
    run_dir.mkdir(exist_ok=True)
    inputs_text = "".join(_line(t, r) for t, r in inputs)
    (run_dir / f"rollouts-{shard}_materialized_inputs.jsonl").write_text(inputs_text, encoding="utf-8")
    success_text = "".join(_line(t, r, reward=1.0) for t, r in successes)
    (run_dir / f"rollouts-{shard}.jsonl").write_text(success_text, encoding="utf-8")


def test_ledger_counts_every_extra_line_of_triplicates_and_several_duplicated_identities(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    # shard a: (0,0) three times, (1,0) twice, (2,0) once; shard b: (3,0) twice, (4,0) once, and (1,0) once
    # more (a duplicate across shards). Lines 10, identities 5: duplicates = 10 - 5 = 5 extra lines,
    # carried by 3 identities ((0,0) x2 extra, (1,0) x2 extra, (3,0) x1 extra).
    _craft(run, "a", [(0, 0), (1, 0), (2, 0)], [(0, 0), (1, 0), (0, 0), (2, 0), (1, 0), (0, 0)])
    _craft(run, "b", [(3, 0), (4, 0)], [(3, 0), (4, 0), (3, 0), (1, 0)])

    report = check_run(run)
    assert report.source == "shards"
    assert (report.planned, report.recorded, report.settled) == (5, 5, 5)
    assert (report.duplicates, report.lost, report.missing, report.unexpected, report.corrupt_lines) == (
        5,
        0,
        0,
        0,
        0,
    )
    assert sorted(report.duplicate_ids) == [(0, 0), (1, 0), (3, 0)]
    assert report.ok is False

    merged = merge_shards(run)
    assert (merged.successes, merged.duplicate_successes_dropped) == (5, 5)
    after = check_run(run)
    assert (after.source, after.duplicates, after.missing, after.ok) == ("merged", 0, 0, True)


# --- a stale writer is refused on every write path ---------------------------------------------------


def _files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def _rec(task: int, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: 0, **extra}


WRITE_PATHS: dict[str, Callable[[ShardWriter], object]] = {
    "append-success": lambda w: w.append(_rec(0, reward=1.0)),
    "append-failure": lambda w: w.append(_rec(1, _ng_failure_class="agent_run_error")),
    "materialized-inputs": lambda w: w.write_materialized_inputs([_rec(7), _rec(8)]),
    "manifest": lambda w: w.write_manifest(
        ShardManifest.build(
            run_id="run-1", shard="s", config_identity=None, inputs_path=w.paths.materialized_inputs
        )
    ),
    "progress": lambda w: w.write_progress(),
}


@pytest.mark.parametrize("write", list(WRITE_PATHS.values()), ids=list(WRITE_PATHS))
def test_a_writer_whose_shard_was_taken_over_writes_nothing_on_any_path(
    tmp_path: Path, write: Callable[[ShardWriter], object]
) -> None:
    stale = ShardWriter(tmp_path, "s", run_id="run-1", config_identity=None).open()
    stale.write_materialized_inputs([_rec(0), _rec(1)])
    stale.append(_rec(0, reward=0.5))
    owner = ShardWriter(tmp_path, "s", run_id="run-1", config_identity=None).open()
    before = _files(tmp_path)
    try:
        with pytest.raises(ShardLockError, match="opened by another writer"):
            write(stale)
        assert _files(tmp_path) == before
        # the owner still writes, and its lines are the only new ones
        owner.append(_rec(1, reward=1.0))
    finally:
        stale.close()
        owner.close()
    lines = (tmp_path / "rollouts-s.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["reward"] for line in lines] == [0.5, 1.0]


# --- aggregation follows the stamp, not the agent's front --------------------------------------------


def _env(agent: str) -> dict[str, Any]:
    return {
        "environment_servers": {
            "example_env": {
                "host": "127.0.0.1",
                "port": 0,
                "agent_server": {"type": "responses_api_agents", "name": agent},
            }
        }
    }


def _agent() -> dict[str, Any]:
    return {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}}


def _result(task: int, reward: float, *, stamp: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        keys.TASK_INDEX: task,
        keys.ROLLOUT_INDEX: 0,
        "agent_ref": {"name": "agent_a"},
        "reward": reward,
        "response": {"output": [], "usage": {"total_tokens": 10}},
    }
    if stamp is not None:
        result[keys.ENVIRONMENT_SERVER] = stamp
    return result


async def test_aggregation_sends_a_stamped_rollout_to_its_stamp_when_the_agent_s_front_differs(
    tmp_path: Path,
) -> None:
    config = {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "agent_a": _agent(),
        "agent_b": _agent(),
        "env_a": _env("agent_a"),  # the front of agent_a
        "env_b": _env("agent_b"),
    }
    # agent_a's rollouts: tasks 0-2 ran through env_b (stamped), task 3 has no stamp (goes to the front).
    results = [
        _result(0, 1.0, stamp="env_b"),
        _result(1, 1.0, stamp="env_b"),
        _result(2, 0.0, stamp="env_b"),
        _result(3, 0.0, stamp=None),
    ]
    async with serve_config(config) as dep:
        topology = Topology.from_config(dep.config)
        assert topology.front_of("agent_a") == "env_a"
        async with ServerClient(topology) as client:
            path = await aggregate_metrics(results, topology, client, output_path=tmp_path / "metrics.json")
        calls = {name: dep.stats(name).aggregate_calls for name in ("env_a", "env_b", "agent_a", "agent_b")}
    assert calls == {"env_a": 1, "env_b": 1, "agent_a": 0, "agent_b": 0}
    assert path is not None
    entries = json.loads(path.read_text(encoding="utf-8"))
    by_server = {e[keys.ENVIRONMENT_SERVER]: e for e in entries}
    assert sorted(by_server) == ["env_a", "env_b"]
    tasks = {
        server: [g[keys.TASK_INDEX] for g in entry["group_level_metrics"]]
        for server, entry in by_server.items()
    }
    assert tasks == {"env_a": [3], "env_b": [0, 1, 2]}
    assert by_server["env_b"]["key_metrics"]["mean/reward"] == pytest.approx(2 / 3)
    assert by_server["env_a"]["key_metrics"]["mean/reward"] == 0.0


# --- the progress file counts what the writer wrote ------------------------------------------------------


def test_progress_counts_each_kind_of_record_exactly(tmp_path: Path) -> None:
    drained = {"_ng_failure_class": "cancelled", "_ng_dispatch_drained": True, "_ng_no_persist": True}
    terminal = {"_ng_failure_class": "agent_run_error", "_ng_failure_terminal": True}
    with ShardWriter(tmp_path, "s", run_id="run-1", config_identity=None, clock=lambda: 5.0) as writer:
        writer.write_materialized_inputs([_rec(t) for t in range(6)])
        for record in [
            _rec(0, reward=1.0),
            _rec(0, reward=1.0, _ng_attempt_index=1),  # a second success of (0, 0): one identity
            _rec(1, reward=0.0),
            {"reward": 1.0},  # a success without identity keys
            {"reward": 0.5},  # and another one
            _rec(2, _ng_failure_class="agent_run_error"),
            _rec(2, _ng_failure_class="agent_run_error", _ng_attempt_index=1),
            _rec(3, **terminal),
            _rec(4, **terminal),
            _rec(5, _ng_failure_class="agent_request_failed", _ng_failure_terminal=False),
            _rec(5, **drained),  # omitted, not kept
            _rec(5, **drained),
            _rec(5, _ng_failure_class="kill_shaped"),  # never written, counted as omitted
        ]:
            writer.append(record)
        progress = writer.write_progress()
    on_disk = json.loads((tmp_path / "rollouts-s.progress.json").read_text(encoding="utf-8"))
    # by hand: identities (0,0), (1,0) + 2 unkeyed = 4 successes; 5 failure lines, 2 of them terminal;
    # 3 omitted; 10 lines written in all
    expected = {
        "run_id": "run-1",
        "shard": "s",
        "planned": 6,
        "succeeded": 4,
        "failed": {"agent_request_failed": 1, "agent_run_error": 4},
        "terminal_failed": 2,
        "omitted": 3,
        "attempts": 10,
        "updated_at": 5.0,
    }
    assert progress.model_dump() == expected
    assert on_disk == expected

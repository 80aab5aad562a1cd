"""Multi-node runs on Ray's own test cluster (``ray.cluster_utils.Cluster``): a head with no CPUs and two
worker nodes, in a child process with its own ``RAY_TMPDIR`` (see ``multinode_scenarios.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
PLANNED = 240  # 120 rows x 2 repeats
NO_LEDGER_FAULTS = {"lost": 0, "missing": 0, "duplicates": 0, "corrupt_lines": 0}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # A short private temp dir: Ray's socket paths must stay short, and no other process may join it.
    with tempfile.TemporaryDirectory(prefix="grmn-", dir="/tmp") as ray_tmp:
        env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO)}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run(
            [sys.executable, "-m", "tests.distributed.multinode_scenarios", ray_tmp],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    scenarios = (
        "spread",
        "control_placed",
        "node_loss",
        "host_node_loss",
        "node_added",
        "control_restarted",
        "store_node_loss",
    )
    print("multi-node figures:", json.dumps({k: result[k] for k in scenarios}, indent=1))
    return result


def test_workers_spread_over_the_cpu_nodes_and_the_driver_stays_on_the_callers_node(
    report: dict[str, Any],
) -> None:
    spread = report["spread"]
    node_a, node_b = report["nodes"]
    assert spread["placed"] == spread["runs_on"]  # placed by strategy, and Ray honoured it
    assert Counter(spread["runs_on"].values()) == {node_a: 2, node_b: 2}  # none on the 0-CPU head
    assert spread["driver_on"] == spread["coordinator_on"] == report["head"]
    assert len(set(spread["pids"])) == 2 + 4  # 1 driver + 1 coordinator + 4 workers, one process each
    assert (spread["planned"], spread["succeeded"], spread["failed"]) == (PLANNED, PLANNED, 0)
    assert spread["lost_workers"] == []
    assert spread["wasted_requests"] == 0
    assert spread["ledger"] == NO_LEDGER_FAULTS


def test_control_actors_go_to_the_node_holding_the_named_resource(report: dict[str, Any]) -> None:
    placed = report["control_placed"]
    node_a, _ = report["nodes"]
    assert placed["driver_on"] == placed["coordinator_on"] == node_a  # not the caller's node (the head)
    assert (placed["planned"], placed["succeeded"], placed["failed"]) == (PLANNED, PLANNED, 0)
    assert placed["wasted_requests"] == 0
    assert placed["ledger"] == NO_LEDGER_FAULTS


def test_a_lost_worker_node_requeues_its_shards_and_the_run_completes(report: dict[str, Any]) -> None:
    loss = report["node_loss"]
    node_a, node_b = report["nodes"]
    on_b = sorted(worker for worker, node in loss["runs_on"].items() if node == node_b)
    assert len(on_b) == 2
    assert loss["lost_workers"] == on_b
    assert set(loss["replacements"].values()) == {node_a}  # replacements go to the surviving node
    assert len(loss["replacements"]) == 2
    assert (loss["planned"], loss["succeeded"], loss["failed"]) == (PLANNED, PLANNED, 0)
    assert loss["ledger"] == NO_LEDGER_FAULTS
    # Only rollouts in flight on the lost node run again elsewhere (each record is written the moment its
    # reply arrives): at most the two lost workers' windows, 4 resident tasks x 2 repeats each; measured
    # 4, 7 and 9. Whole shards never run again.
    assert 0 <= loss["wasted_requests"] <= 2 * (4 * 2)


def test_losing_the_node_of_the_caller_and_host_ends_the_run_and_running_it_again_resumes(
    report: dict[str, Any],
) -> None:
    lost = report["host_node_loss"]
    # The run was started on the removed node, so its driver and coordinator actors were there too: they
    # are pinned to the caller's node (see the spread test).
    assert lost["caller_on"] == lost["node"]
    assert lost["first_run"] == "ActorDiedError"  # the caller died with its node: that run ended there
    # Running it again from the head resumed the same run: what was recorded before the loss was kept,
    # only the rest was sent, and every planned rollout is recorded exactly once.
    assert (lost["planned"], lost["succeeded"], lost["failed"]) == (PLANNED, PLANNED, 0)
    assert lost["already_done"] + lost["dispatched"] == PLANNED
    assert 60 <= lost["already_done"] <= lost["sent_before_loss"]
    assert lost["ledger"] == NO_LEDGER_FAULTS
    # Rollouts that finished on the servers but were not recorded before the loss ran again: at most the
    # four workers' windows (4 resident tasks x 2 repeats each).
    assert lost["wasted_requests"] == lost["sent_before_loss"] - lost["already_done"]
    assert 0 <= lost["wasted_requests"] <= 4 * (4 * 2)


def test_a_node_that_joins_mid_run_receives_a_moved_worker_and_shards(report: dict[str, Any]) -> None:
    added = report["node_added"]
    node_a, _ = report["nodes"]
    assert set(added["runs_on"].values()) == {node_a}  # node B was removed by the node-loss run
    # One worker of the crowded node finished its shards and left; its replacement went to the new node
    # and ran shards there. Then each node holds a worker: no further move.
    assert added["moved"] == ["w3"]
    assert added["replacements"] == {"w4": added["added"]}
    assert added["shards_by_worker"]["w4"] >= 1
    # shard_size=5 rollouts, tasks of 2 never split: 3 tasks (6 rollouts) per shard, 240 / 6 = 40 shards
    assert sum(added["shards_by_worker"].values()) == 40
    assert added["lost_workers"] == []
    assert (added["planned"], added["succeeded"], added["failed"]) == (PLANNED, PLANNED, 0)
    assert added["wasted_requests"] == 0  # a move finishes shards, it does not cut them: nothing runs twice
    assert added["ledger"] == NO_LEDGER_FAULTS


def test_the_driver_and_the_coordinator_killed_mid_run_come_back_and_the_run_ends_in_the_same_call(
    report: dict[str, Any],
) -> None:
    restarted = report["control_restarted"]
    node_a, _ = report["nodes"]
    assert restarted["driver_on"] == restarted["coordinator_on"] == node_a
    driver_pid, coordinator_pid = restarted["pids"][:2]
    # each control actor answered from a new process before the run ended (Ray restarted it)
    assert restarted["restarted"]["driver"][0] != driver_pid
    assert restarted["restarted"]["coordinator"][0] != coordinator_pid
    assert restarted["restarted"]["coordinator"][1] < PLANNED  # killed mid-run, not after the end
    assert (restarted["planned"], restarted["succeeded"], restarted["failed"]) == (PLANNED, PLANNED, 0)
    assert restarted["lost_workers"] == []
    assert restarted["wasted_requests"] == 0  # no /run sent twice
    assert restarted["ledger"] == NO_LEDGER_FAULTS


def test_a_run_on_s3_with_no_shared_folder_loses_a_node_and_completes_from_the_store(
    report: dict[str, Any],
) -> None:
    # Issue 34: no folder is shared by the nodes; the lost node's shards are taken over from the segments
    # the store committed, and the merged output is one object on the store.
    lost = report["store_node_loss"]
    assert lost["lost_node_had_shards"] is True
    assert (lost["planned"], lost["succeeded"], lost["failed"]) == (PLANNED, PLANNED, 0)
    assert lost["ledger"] == NO_LEDGER_FAULTS
    assert lost["rollouts_path"] == "s3://multinode/store_node_loss/rollouts.jsonl"
    assert 0 <= lost["wasted_requests"] < PLANNED

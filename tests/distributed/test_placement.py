"""Worker placement: CPU nodes only, fewest live workers first, replacements away from a lost node."""

from __future__ import annotations

import os
from typing import Any

import pytest

from gym_ray.distributed.placement import WorkerPlacement, ray_init_kwargs

HEAD, A, B = ("0" * 56, "a" * 56, "b" * 56)
X, Y = ("c" * 56, "d" * 56)


def _node(node_id: str, cpus: float, *, alive: bool = True) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus} if cpus else {}}


def _chosen(placement: WorkerPlacement, workers: list[str], live: set[str]) -> list[str | None]:
    chosen = []
    for worker in workers:
        placement.options(worker, live)
        live.add(worker)
        chosen.append(placement.node_of(worker))
    return chosen


def test_workers_go_round_robin_to_the_cpu_nodes_and_leave_a_zero_cpu_head_alone() -> None:
    placement = WorkerPlacement([_node(HEAD, 0), _node(A, 1), _node(B, 2)])
    assert _chosen(placement, ["w0", "w1", "w2", "w3", "w4"], set()) == [A, B, A, B, A]
    options = placement.options("w5", {"w0", "w1", "w2", "w3", "w4"})
    assert options["num_cpus"] == 0
    assert (options["scheduling_strategy"].node_id, options["scheduling_strategy"].soft) == (B, False)


def test_a_replacement_goes_to_the_node_with_the_fewest_live_workers() -> None:
    placement = WorkerPlacement([_node(A, 1), _node(B, 1)])
    _chosen(placement, ["w0", "w1", "w2", "w3"], set())  # A, B, A, B
    # w1 and w3 (node B) died: the replacement goes to B, which now holds none of the live workers.
    assert _chosen(placement, ["w4"], {"w0", "w2"}) == [B]


def test_dead_nodes_are_skipped_and_a_cluster_without_cpus_uses_every_alive_node() -> None:
    placement = WorkerPlacement([_node(A, 1, alive=False), _node(B, 1)])
    assert _chosen(placement, ["w0", "w1"], set()) == [B, B]
    cpu_less = WorkerPlacement([_node(X, 0), _node(Y, 0)])
    assert _chosen(cpu_less, ["w0", "w1"], set()) == [X, Y]


def test_a_local_run_never_joins_another_cluster_on_the_machine(monkeypatch: Any) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_kwargs(None)["address"] == "local"
    # Ray prestarts one idle worker process per logical CPU for the first driver: at most what a run with
    # the default worker count uses (16 workers and the host actor).
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert ray_init_kwargs(None)["num_cpus"] == 17
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert ray_init_kwargs(None)["num_cpus"] == 2
    assert ray_init_kwargs("ray://head:10001") == {"address": "ray://head:10001"}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_init_kwargs(None) == {"address": None}


def test_a_node_that_joins_with_no_workers_gets_the_last_started_worker_of_the_most_crowded_node() -> None:
    nodes = [_node(HEAD, 0), _node(A, 1)]
    placement = WorkerPlacement(nodes)
    assert _chosen(placement, ["w0", "w1", "w2"], set()) == [A, A, A]
    assert placement.worker_to_move(["w0", "w1", "w2"]) is None  # one node: nothing to spread over
    nodes.append(_node(B, 1))  # B joins mid-run
    assert placement.worker_to_move(["w0", "w1", "w2"]) == "w2"
    # w2 finished its shards and left; its replacement w3 goes to B, which then holds one: even enough.
    assert _chosen(placement, ["w3"], {"w0", "w1"}) == [B]
    assert placement.worker_to_move(["w0", "w1", "w3"]) is None


def test_no_move_when_the_crowded_node_has_a_single_worker() -> None:
    nodes = [_node(A, 1), _node(B, 1)]
    placement = WorkerPlacement(nodes)
    assert _chosen(placement, ["w0", "w1"], set()) == [A, B]
    nodes.append(_node(X, 4))
    assert placement.worker_to_move(["w0", "w1"]) is None  # moving one would only empty another node


def test_the_lean_head_parameters_hold_only_while_ray_init_builds_a_head() -> None:
    from ray._private import node, parameter

    from gym_ray.distributed.placement import LEAN_HEAD_PARAMS, _lean_head

    original, original_node = parameter.RayParams, node.Node
    assert LEAN_HEAD_PARAMS == {"no_monitor": True, "include_log_monitor": False}
    with _lean_head() as lean:
        assert lean == (True, True)
        assert os.environ["RAY_prestart_worker_first_driver"] == "0"  # no idle worker processes
        params = parameter.RayParams()
        assert (params.no_monitor, params.include_log_monitor) == (True, False)
        explicit = parameter.RayParams(no_monitor=False)  # a caller's own value wins
        assert explicit.no_monitor is False
        assert issubclass(node.Node, original_node)
        head = object.__new__(node.Node)  # only the one method is called: no process is started
        head.start_api_server(include_dashboard=False, raise_on_failure=True)
        assert head._webui_url is None
    assert (parameter.RayParams, node.Node) == (original, original_node)
    assert "RAY_prestart_worker_first_driver" not in os.environ  # the raylet's environment only
    with pytest.raises(RuntimeError, match="boom"), _lean_head():
        raise RuntimeError("boom")
    assert (parameter.RayParams, node.Node) == (original, original_node)  # put back when ray.init fails
    assert original().include_log_monitor is None  # Ray's own default is untouched


def test_a_prestart_setting_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from gym_ray.distributed.placement import _lean_head

    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    with _lean_head():
        assert os.environ["RAY_prestart_worker_first_driver"] == "1"
    assert os.environ["RAY_prestart_worker_first_driver"] == "1"

"""Multi-node scenarios on Ray's own test cluster (``ray.cluster_utils.Cluster``), one per process.

Run as ``python -m tests.distributed.multinode_scenarios WORKDIR`` with ``RAY_TMPDIR`` set to a
private folder (the cluster then cannot be joined by another process's ``ray.init()``). The last line of
stdout is a JSON report that tests/distributed/test_multinode.py asserts on.

Cluster: a head node with ``num_cpus=0`` (it holds the caller and the run's control actors: the driver and
the coordinator) and two worker nodes with one CPU each; reference servers in this process, 40 ms per rollout.

Scenarios, three runs on one cluster (a cluster start costs seconds):
- ``spread``: 4 workers; where each one was placed and where it actually runs, where the driver and the
  coordinator actors run, and the process id of every actor (one process each).
- ``control_placed``: as ``spread`` with ``control_actors_resource`` naming a resource only the first
  worker node holds: the driver and the coordinator run there, not on the caller's node.
- ``node_loss``: 4 workers; once 60 rollouts are done, the second worker node is removed (its two
  workers die with it); the run must finish on the other node with nothing lost.
- ``host_node_loss``: the run is started by a process on a third node (an actor there, as a Ray job's
  driver placed with ``entrypoint_resources`` is), so the run's driver and coordinator actors live
  there too; once 60 rollouts are done that node is removed. The caller and both die with it, Ray ends
  the workers they owned, and running the same collection again from the head resumes: only what was not
  recorded runs, nothing lost and nothing twice.
- ``node_added``: 4 workers on the one worker node left; a one-CPU node joins mid-run: one worker finishes
  its shards and its replacement runs on the new node, nothing lost and nothing run twice.
- ``control_restarted``: as ``control_placed`` (the control actors on a worker node), 300 ms per rollout;
  the driver's process is killed once 40 rollouts are done, the coordinator's 40 rollouts after the driver
  is back: Ray restarts each, and the run ends in the same call with nothing lost and nothing sent twice.
- ``store_node_loss``: the run folder on S3 (moto's server on 127.0.0.1), no folder shared by the nodes;
  a third one-CPU node joins with its own stage folder, and is removed once 60 rollouts are done.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROWS = 120
REPEATS = 2
NODE_OBJECT_STORE_BYTES = 80 * 1024 * 1024
CONTROL_RESOURCE = "gym_ray_control"


def _rows(count: int) -> list[dict[str, Any]]:
    from gym_ray import keys
    from gym_ray.servers import bundled_dataset_path

    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    rows = []
    for index in range(count):
        row = json.loads(lines[index % len(lines)])
        row["row_number"] = index
        row[keys.AGENT_REF] = {"name": "arith_agent"}
        rows.append(row)
    return rows


def _completed(servers: Any) -> int:
    return sum(servers.stats(env).completed for env in ("arith_env", "arith_env_hard"))


async def _until(predicate: Any, what: str, timeout_s: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _one_run(
    cluster: Any,
    servers: Any,
    run_dir: Path,
    *,
    lose_node: Any = None,
    add_node: bool = False,
    shard_size: int = 10,
    max_resident_tasks: int = 4,
    control_resource: str | None = None,
    kill_control: bool = False,
) -> dict[str, Any]:
    """A 4-worker run of ``ROWS`` x ``REPEATS`` rollouts; removes ``lose_node`` after 60 finished rollouts,
    or adds a one-CPU node once the workers run (``add_node``)."""
    import ray

    from gym_ray.config.run_config import resolve_run_config
    from gym_ray.distributed.api import RunActors, plan_from_config, run_actors
    from gym_ray.record.ledger import check_run

    servers.reset_stats()
    run = await resolve_run_config(
        servers.config,
        settings={
            "output_dir": str(run_dir),
            "shard_size": shard_size,
            "max_resident_tasks": max_resident_tasks,
            "num_repeats": REPEATS,
            "control_actors_resource": control_resource,
        },
    )
    started: list[RunActors] = []
    task = asyncio.ensure_future(
        run_actors(
            run,
            functools.partial(plan_from_config, run, ray.put(_rows(ROWS))),
            run_dir=str(run_dir),
            num_workers=4,
            on_started=started.append,
            rebalance_every_s=0.5,
        )
    )
    await _until(lambda: bool(started) or task.done(), "the actors to start")
    actors = started[0]
    initial = dict(actors.workers)
    report: dict[str, Any] = {"placed": {worker: actors.nodes.get(worker) for worker in initial}}
    nodes_now = await asyncio.gather(*(handle.node_id.remote() for handle in initial.values()))
    report["runs_on"] = dict(zip(initial, nodes_now, strict=True))
    report["driver_on"] = await actors.driver.node_id.remote()
    report["coordinator_on"] = await actors.coordinator.node_id.remote()
    # one process per actor: the driver, the coordinator and each worker
    pids = [actors.driver.pid.remote(), actors.coordinator.pid.remote()]
    report["pids"] = await asyncio.gather(*pids, *(handle.pid.remote() for handle in initial.values()))
    if lose_node is not None:
        await _until(lambda: _completed(servers) >= 60 or task.done(), "60 finished rollouts")
        cluster.remove_node(lose_node)
    if kill_control:
        report["restarted"] = {}
        for name, handle in (("driver", actors.driver), ("coordinator", actors.coordinator)):
            mark = _completed(servers) + 40
            await _until(lambda m=mark: _completed(servers) >= m or task.done(), f"{mark} finished rollouts")
            os.kill(await handle.pid.remote(), signal.SIGKILL)
            # the call waits for the restarted process: its pid, and how far the run was when it answered
            report["restarted"][name] = [await handle.pid.remote(), _completed(servers)]
    if add_node:
        await _until(lambda: _completed(servers) >= 1 or task.done(), "a first finished rollout")
        # Ray starts the raylet from the main thread only; this loop pauses meanwhile, the actors do not.
        node = cluster.add_node(num_cpus=1, object_store_memory=NODE_OBJECT_STORE_BYTES)
        report["added"] = node.node_id
    result = await task
    ledger = check_run(run_dir).as_dict()
    summary = json.loads(await asyncio.to_thread(Path(result.summary_path).read_text))
    report.update(
        planned=result.planned,
        succeeded=result.succeeded,
        failed=result.failed,
        lost_workers=sorted(actors.lost),
        replacements={w: actors.nodes.get(w) for w in actors.workers if w not in initial},
        moved=list(actors.moved),
        shards_by_worker=dict(Counter(t["worker"] for t in summary["distributed"]["shard_timings"])),
        wasted_requests=_completed(servers) - result.planned,
        ledger={k: ledger[k] for k in ("lost", "missing", "duplicates", "corrupt_lines")},
    )
    return report


def _caller_actor() -> Any:
    """A Ray actor class that runs :func:`gym_ray.distributed.api.acollect` where it is placed."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Caller:
        async def collect(self, config: dict[str, Any], rows: list[Any], settings: dict[str, Any]) -> Any:
            from gym_ray.distributed.api import acollect

            result = await acollect(config, rows=rows[0], progress=False, **settings)
            return result.model_dump()

        def node_id(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

    return Caller


async def _quiet(servers: Any, *, for_s: float = 2.0, timeout_s: float = 60.0) -> None:
    """Until no rollout has finished on ``servers`` for ``for_s`` seconds: the lost run's workers are gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen, since = _completed(servers), loop.time()
    while loop.time() - since < for_s:
        if loop.time() > deadline:
            raise TimeoutError("rollouts kept finishing after the host's node was removed")
        await asyncio.sleep(0.05)
        if (now := _completed(servers)) != seen:
            seen, since = now, loop.time()


async def _host_node_lost(cluster: Any, servers: Any, run_dir: Path) -> dict[str, Any]:
    """The node of the run's caller and host actor is removed mid-run; the same run is then resumed."""
    import ray

    from gym_ray.distributed.api import acollect
    from gym_ray.record.ledger import check_run

    servers.reset_stats()
    node = cluster.add_node(num_cpus=0, resources={"caller": 1}, object_store_memory=NODE_OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    caller = _caller_actor().options(resources={"caller": 1}).remote()
    settings = {
        "output_dir": str(run_dir),
        "num_workers": 4,
        "shard_size": 10,
        "max_resident_tasks": 4,
        "num_repeats": REPEATS,
    }
    report: dict[str, Any] = {"node": node.node_id, "caller_on": await caller.node_id.remote()}
    first = caller.collect.remote(servers.config, [_rows(ROWS)], settings)
    await _until(lambda: _completed(servers) >= 60, "60 finished rollouts")
    cluster.remove_node(node)
    try:
        await first
        report["first_run"] = "finished"
    except ray.exceptions.RayError as exc:
        report["first_run"] = type(exc).__name__
    await _quiet(servers)
    report["sent_before_loss"] = _completed(servers)
    result = await acollect(servers.config, rows=_rows(ROWS), progress=False, **settings)
    ledger = check_run(run_dir).as_dict()
    report.update(
        planned=result.planned,
        succeeded=result.succeeded,
        failed=result.failed,
        already_done=result.already_done,
        dispatched=result.dispatched,
        wasted_requests=_completed(servers) - result.planned,
        ledger={k: ledger[k] for k in ("lost", "missing", "duplicates", "corrupt_lines")},
    )
    return report


async def _store_node_lost(cluster: Any, servers: Any, url: str, stage_c: Path) -> dict[str, Any]:
    """A run whose folder is on S3 (moto's server) and that no node shares: every process keeps its own
    copy (a third node's under ``stage_c``); once 60 rollouts are done that node is removed, and its
    shards are taken over from what the store committed."""
    from gym_ray.distributed.api import acollect
    from gym_ray.record.ledger import check_run

    servers.reset_stats()
    node = cluster.add_node(
        num_cpus=1, object_store_memory=NODE_OBJECT_STORE_BYTES, env_vars={"GYM_RAY_STAGE_DIR": str(stage_c)}
    )
    cluster.wait_for_nodes()
    settings = {"num_workers": 4, "shard_size": 10, "max_resident_tasks": 4, "num_repeats": REPEATS}
    run = asyncio.ensure_future(
        acollect(servers.config, rows=_rows(ROWS), progress=False, output_dir=url, **settings)
    )

    def holds_shards() -> bool:  # the node's own copy holds shard files: a worker took a shard there
        return any(stage_c.rglob("rollouts-*.jsonl"))

    # 60 finished rollouts and a shard taken on the node (its worker may start after the others)
    await _until(lambda: (_completed(servers) >= 60 and holds_shards()) or run.done(), "a shard on the node")
    report: dict[str, Any] = {"lost_node_had_shards": await asyncio.to_thread(holds_shards)}
    cluster.remove_node(node)
    result = await run
    ledger = check_run(url).as_dict()
    report.update(
        planned=result.planned,
        succeeded=result.succeeded,
        failed=result.failed,
        rollouts_path=result.rollouts_path,
        wasted_requests=_completed(servers) - result.planned,
        ledger={k: ledger[k] for k in ("lost", "missing", "duplicates", "corrupt_lines")},
    )
    return report


async def _scenarios(workdir: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from gym_ray.bench.store_bench import start_moto
    from gym_ray.servers import load_bundled_config, start_in_thread
    from tests.store.conftest import store_env

    # an S3 endpoint for ``store_node_loss``, in the environment every node (and so every actor) inherits
    moto_port = _free_port()
    moto = start_moto(moto_port)
    os.environ.update(store_env(f"http://127.0.0.1:{moto_port}"), GYM_RAY_STAGE_DIR=str(workdir / "stage"))
    import boto3

    boto3.client("s3").create_bucket(Bucket="multinode")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": NODE_OBJECT_STORE_BYTES},
    )
    # the first worker node also holds the resource that places the control actors in ``control_placed``
    nodes = [
        cluster.add_node(num_cpus=1, object_store_memory=NODE_OBJECT_STORE_BYTES, resources=resources)
        for resources in ({CONTROL_RESOURCE: 1}, {})
    ]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    cfg = load_bundled_config()
    env = cfg["arith_env"]["environment_servers"]["example_env"]
    env.update(latency_ms=40, latency_jitter_ms=0)
    report: dict[str, Any] = {"head": cluster.head_node.node_id, "nodes": [node.node_id for node in nodes]}
    try:
        with start_in_thread(cfg) as servers:
            report["spread"] = await _one_run(cluster, servers, workdir / "spread")
            report["control_placed"] = await _one_run(
                cluster, servers, workdir / "control_placed", control_resource=CONTROL_RESOURCE
            )
            report["node_loss"] = await _one_run(cluster, servers, workdir / "node_loss", lose_node=nodes[1])
            report["host_node_loss"] = await _host_node_lost(cluster, servers, workdir / "host_node_loss")
        # 300 ms per rollout, 2 in flight per worker, 10 rollouts per shard: a run of ~10 s on one node,
        # long enough for a node to join and one worker to move there.
        env["latency_ms"] = 300
        with start_in_thread(cfg) as slow:
            report["node_added"] = await _one_run(
                cluster, slow, workdir / "node_added", add_node=True, shard_size=5, max_resident_tasks=1
            )
            report["control_restarted"] = await _one_run(
                cluster,
                slow,
                workdir / "control_restarted",
                control_resource=CONTROL_RESOURCE,
                kill_control=True,
            )
        env["latency_ms"] = 40
        with start_in_thread(cfg) as servers:
            report["store_node_loss"] = await _store_node_lost(
                cluster, servers, "s3://multinode/store_node_loss", workdir / "stage-c"
            )
    finally:
        ray.shutdown()
        cluster.shutdown()
        moto.terminate()
        moto.wait(timeout=30)
    return report


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str]) -> int:
    report = asyncio.run(_scenarios(Path(argv[1])))
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

"""Benchmark: the end of a run, "last rollout recorded -> metrics written", with and without the work the
coordinator does while the run goes on.

``gym-ray bench tail -n 1000000``: writes ``shards`` shard files of ``n`` records as a run leaves them
(:func:`gym_ray.bench.merge_bench.write_shards`), starts the instant reference server in another process
(:func:`gym_ray.bench.dispatch.serve_bench_server`, whose ``bench_env`` the records are stamped with), then
in a fresh child process each:

- ``cold``: the merge of every shard, then ``aggregate_run`` (today's end of a run without the ahead work;
  a single-process run ends this way);
- ``ahead``: every shard but the last reduced, appended to the merged prefix and grouped for
  ``/aggregate_metrics`` one after the other, as the coordinator does after each shard report (timed
  apart: it overlaps the run), then what is left once the last shard is recorded: the merge's tail and
  the aggregate.

Each child reports wall seconds and its own CPU seconds (threads included) per step; the difference between
an aggregate's wall time and the collector's CPU in it is mostly the environment server's own work on the
body (another process: it parses the rows, computes the metrics, writes the reply), which no collector can
do ahead: ``/aggregate_metrics`` takes every row of a server in one call. Both children's metrics files
must be byte-identical (checked).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def _aggregate(run_dir: Path, config: dict[str, Any]) -> tuple[float, float, str]:
    from gym_ray.config.topology import Topology
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.finalize.aggregate import aggregate_run

    topology = Topology.from_config(config)
    async with ServerClient(topology) as client:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        path = await aggregate_run(run_dir, topology, client, raise_on_error=True)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if path is None:
        raise RuntimeError(f"tail bench: no metrics written for {run_dir}")
    return wall, cpu, hashlib.sha256(path.read_bytes()).hexdigest()


def _timed(work: Any) -> tuple[Any, float, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = work()
    return out, time.perf_counter() - wall0, time.process_time() - cpu0


def _child(mode: str, run_dir: str, config_path: str) -> None:
    from gym_ray.config.topology import Topology
    from gym_ray.finalize import aggregate_ahead
    from gym_ray.finalize.merge import merge_shards
    from gym_ray.finalize.merge_ahead import grow_prefix, reduce_ahead
    from gym_ray.record.shard_files import list_shards

    root = Path(run_dir)
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    figures: dict[str, Any] = {}
    if mode == "ahead":
        shards = list_shards(root)
        grouping = aggregate_ahead.AggregationAhead(root, Topology.from_config(config))

        def during_run() -> int:
            for shard in shards[:-1]:
                reduce_ahead(root, shard)
                grow_prefix(root, shards)
                grouping.feed()
            return grouping.rows_grouped

        figures["grouped_ahead"], figures["during_run_s"], figures["during_run_cpu_s"] = _timed(during_run)
        aggregate_ahead.register(root, grouping)
    merged, figures["merge_s"], figures["merge_cpu_s"] = _timed(lambda: merge_shards(root))
    figures["successes"] = merged.successes
    wall, cpu, digest = asyncio.run(_aggregate(root, config))
    figures.update(aggregate_s=wall, aggregate_cpu_s=cpu, metrics_sha256=digest)
    print(json.dumps(figures))


def _run_child(mode: str, run_dir: Path, config_path: Path) -> dict[str, Any]:
    from gym_ray.bench.child import run_module_child

    return run_module_child(
        "gym_ray.bench.tail_bench",
        [f"--{mode}", str(run_dir), str(config_path)],
        what=f"tail bench child ({mode})",
    )


def run_tail_bench(rows: int = 1_000_000, shards: int = 64) -> dict[str, Any]:
    """The end-of-run tail of ``rows`` records in ``shards`` shards, cold and with the ahead work (module).

    Returns:
        ``{"rows", "shards", "cold": {...}, "ahead": {...}, "cold_tail_s", "ahead_tail_s", "tail_ratio",
        "server_s_estimate"}``; each child's figures are ``merge_s`` / ``merge_cpu_s``, ``aggregate_s`` /
        ``aggregate_cpu_s`` (the collector's CPU in it), and for ``ahead`` ``during_run_s`` /
        ``during_run_cpu_s`` / ``grouped_ahead``. Also printed.

    Raises:
        ValueError: ``rows`` < 1 or ``shards`` < 2.
        RuntimeError: A child failed, or the two metrics files differ.
    """
    from gym_ray.bench.dispatch import serve_bench_server
    from gym_ray.bench.merge_bench import write_shards

    if rows < 1 or shards < 2:
        raise ValueError(f"rows={rows!r}, shards={shards!r}: rows must be >= 1 and shards >= 2")
    with tempfile.TemporaryDirectory(prefix="gym-ray-tail-bench-") as tmp, serve_bench_server() as config:
        base = Path(tmp)
        config_path = base / "config.json"
        config_path.write_text(json.dumps(config), encoding="utf-8")
        cold_dir, ahead_dir = base / "cold", base / "ahead"
        for run_dir in (cold_dir, ahead_dir):
            run_dir.mkdir()
            write_shards(run_dir, rows, shards)
        cold = _run_child("cold", cold_dir, config_path)
        ahead = _run_child("ahead", ahead_dir, config_path)
    if cold["metrics_sha256"] != ahead["metrics_sha256"] or cold["successes"] != ahead["successes"]:
        raise RuntimeError(f"tail bench: the two ends wrote different metrics: {cold} / {ahead}")
    cold_tail = cold["merge_s"] + cold["aggregate_s"]
    ahead_tail = ahead["merge_s"] + ahead["aggregate_s"]
    result: dict[str, Any] = {
        "rows": rows,
        "shards": shards,
        "cold": cold,
        "ahead": ahead,
        "cold_tail_s": cold_tail,
        "ahead_tail_s": ahead_tail,
        "tail_ratio": ahead_tail / cold_tail if cold_tail > 0 else 0.0,
        # what the collector did not spend its own CPU on while it waited for the reply
        "server_s_estimate": max(0.0, ahead["aggregate_s"] - ahead["aggregate_cpu_s"]),
    }
    print(
        f"tail bench: rows={rows} shards={shards}: last rollout -> metrics written {cold_tail:.2f} s cold "
        f"(merge {cold['merge_s']:.2f} + aggregate {cold['aggregate_s']:.2f}, collector CPU "
        f"{cold['aggregate_cpu_s']:.2f}), {ahead_tail:.2f} s with the ahead work (merge tail "
        f"{ahead['merge_s']:.2f} + aggregate {ahead['aggregate_s']:.2f}, collector CPU "
        f"{ahead['aggregate_cpu_s']:.2f}; {ahead['during_run_s']:.2f} s done while the run went on); "
        f"ratio {result['tail_ratio']:.2f}; the server's own share about {result['server_s_estimate']:.2f} s",
        flush=True,
    )
    return result


def main(argv: list[str]) -> int:
    """``python -m gym_ray.bench.tail_bench [rows [shards]]``; ``--cold`` / ``--ahead DIR CONFIG`` are the
    measured processes."""
    if argv[:1] in (["--cold"], ["--ahead"]) and len(argv) == 3:
        _child(argv[0][2:], argv[1], argv[2])
        return 0
    numbers = [int(a) for a in argv[:2]]
    print(json.dumps(run_tail_bench(*numbers), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

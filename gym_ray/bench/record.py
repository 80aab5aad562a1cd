"""Benchmark: collector CPU per rollout with recording on, versus a bare aiohttp loop.

``gym-ray bench record``: the dispatch benchmark (reference server in instant mode, in its own process)
with every outcome appended through the shard's locked writer (flush per record, fsync every 256 and at
close). Reports CPU microseconds per rollout of the bare loop, of ``run_shard`` (dispatch + record), and of
planning (cutting and writing the shard's materialized inputs), all measured in one run. ``run_shard`` runs
with the collector's garbage-collection setting (:func:`gym_ray.run._gc.collecting_rarely`), as ``gym-ray
run`` and every worker actor run it; the bare loop, a plain Python loop, keeps Python's.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from gym_ray.bench.dispatch import _bare_loop, _env_url, bench_rows, serve_bench_server
from gym_ray.config.run_config import RunConfig
from gym_ray.run._gc import collecting_rarely
from gym_ray.run.collect import client_for, plan_run, run_shard


async def _record_loop(config: dict[str, Any], folder: Path, n: int, concurrency: int) -> dict[str, float]:
    run = RunConfig.from_dict(
        {**config, "max_resident_tasks": concurrency, "max_connections": concurrency, "shard_size": n}
    )
    topology = run.topology
    cpu0 = time.process_time()
    plan = plan_run(bench_rows(n), folder, config_identity=topology.identity_digest(), shard_size=n)
    plan_cpu = time.process_time() - cpu0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    # with the collector's garbage-collection setting, as `gym-ray run` and every worker actor run shards
    with collecting_rarely(freeze=False):
        async with client_for(run) as client:
            report = await run_shard(plan.shards[0], client=client, run=run)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if report.succeeded != n:
        raise RuntimeError(f"recorded {report.succeeded} of {n} rollouts")
    return {
        "plan_cpu_us_per_rollout": plan_cpu / n * 1e6,
        "cpu_us_per_rollout": cpu / n * 1e6,
        "wall_s": wall,
        "rollouts_per_s": n / wall,
    }


async def _measure(config: dict[str, Any], n: int, concurrency: int) -> dict[str, Any]:
    url = _env_url(config) + "/run"
    with tempfile.TemporaryDirectory(prefix="gym-ray-bench-") as tmp:
        await _bare_loop(url, 500, concurrency)
        await _record_loop(config, Path(tmp) / "warmup", 500, concurrency)
        gc.collect()  # each timed loop starts with what the warm-ups left collected
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await _bare_loop(url, n, concurrency)
        bare_cpu, bare_wall = time.process_time() - cpu0, time.perf_counter() - wall0
        gc.collect()
        recorded = await _record_loop(config, Path(tmp) / "run", n, concurrency)
    bare = {"cpu_us_per_rollout": bare_cpu / n * 1e6, "wall_s": bare_wall, "rollouts_per_s": n / bare_wall}
    return {
        "n": n,
        "concurrency": concurrency,
        "bare_aiohttp": bare,
        "run_shard_recording": recorded,
        "cpu_ratio": recorded["cpu_us_per_rollout"] / bare["cpu_us_per_rollout"],
    }


def run_record_bench(n: int = 20000, concurrency: int = 256) -> dict[str, Any]:
    """Measure recording's cost: ``run_shard`` (dispatch + locked shard writer) vs a bare aiohttp loop.

    Returns:
        ``{"n", "concurrency", "bare_aiohttp", "run_shard_recording", "cpu_ratio"}``; also printed.
    """
    with serve_bench_server() as config:
        result = asyncio.run(_measure(config, n, concurrency))
    rec = result["run_shard_recording"]
    print(
        f"record bench: n={n} concurrency={concurrency} "
        f"bare={result['bare_aiohttp']['cpu_us_per_rollout']:.0f} us/rollout "
        f"run_shard={rec['cpu_us_per_rollout']:.0f} us/rollout "
        f"(planning {rec['plan_cpu_us_per_rollout']:.0f} us/rollout more) ratio={result['cpu_ratio']:.2f}"
    )
    return result

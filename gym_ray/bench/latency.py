"""Benchmark: with slow environment servers, bounded dispatch keeps every slot busy.

The reference environment server answers each ``/run`` after a fixed delay (``latency_ms``, no jitter)
and runs in a *separate process*. ``run_examples`` drives it with ``max_resident_tasks = in_flight`` (and
the connector ``limit`` equal to it). The ideal throughput is ``in_flight / latency``: 256 slots of
500 ms give 512 rollouts/s. The figure reported is the efficiency, measured over ideal (target >= 0.98):
what the collector loses between one rollout finishing and the next one being on the wire.

A warm-up of ``in_flight`` rows opens the connections first; the measured run reuses the helper, so its
figure excludes connection set-up but includes the first wave's ramp and the last wave's tail. The same
rows then go through a bare aiohttp loop (``in_flight`` coroutines POSTing back to back, same limits):
its efficiency is what the server and the machine allow, so the gap between the two is the collector's.

Run: ``python -m gym_ray.bench.latency [latency_ms] [in_flight] [rollouts]``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

from gym_ray.bench.dispatch import bench_config, bench_rows, serve_bench_server
from gym_ray.errors import UsageError
from gym_ray.helper import RolloutCollectionHelper


def latency_config(latency_ms: float) -> dict[str, Any]:
    """The benchmark's config (:func:`gym_ray.bench.dispatch.bench_config`) with a fixed server delay."""
    config = copy.deepcopy(bench_config())
    env = config["bench_env"]["environment_servers"]["example_env"]
    env["latency_ms"] = latency_ms
    env["latency_jitter_ms"] = 0
    return config


async def _drive(
    helper: RolloutCollectionHelper, n: int, offset: int, in_flight: int
) -> tuple[int, float, float | None]:
    """Run ``n`` rows.

    Returns:
        (completed, seconds from the first admission to the last completion, steady-state rollouts/s:
        the rate between the ``n // 4``-th and the ``3 * n // 4``-th completion, None when n < 8).
    """
    done = 0
    quarter, three_quarters = n // 4, 3 * n // 4
    marks: dict[int, float] = {}
    completions = helper.run_examples(bench_rows(n, offset), max_resident_tasks=in_flight)
    started = time.perf_counter()
    try:
        async for _row, _result in completions:
            done += 1
            if done in (quarter, three_quarters):
                marks[done] = time.perf_counter()
    finally:
        await completions.aclose()
    wall_s = time.perf_counter() - started
    steady = None
    if n >= 8 and len(marks) == 2 and marks[three_quarters] > marks[quarter]:
        steady = (three_quarters - quarter) / (marks[three_quarters] - marks[quarter])
    return done, wall_s, steady


async def _bare_loop(url: str, n: int, offset: int, in_flight: int) -> tuple[int, float]:
    """The baseline: ``in_flight`` plain aiohttp loops POSTing rows back to back, same limits.

    Returns:
        (completed, seconds for the ``n`` rows after a warm-up of ``in_flight`` rows).
    """
    connector = aiohttp.TCPConnector(limit=in_flight, limit_per_host=0, keepalive_timeout=15.0)
    timeout = aiohttp.ClientTimeout(total=900.0, connect=10.0, sock_connect=10.0)
    headers = {"Content-Type": "application/json"}
    done = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:

        async def loop(rows: Iterator[dict[str, Any]]) -> None:
            nonlocal done
            for row in rows:
                async with session.post(url, data=json.dumps(row).encode(), headers=headers) as resp:
                    resp.raise_for_status()
                    json.loads(await resp.read())
                done += 1

        async def run(rows: Iterator[dict[str, Any]]) -> float:
            started = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for _ in range(in_flight):
                    tg.create_task(loop(rows))
            return time.perf_counter() - started

        await run(bench_rows(in_flight, 0))  # warm-up: opens the connections
        done = 0
        wall_s = await run(bench_rows(n, offset))
    return done, wall_s


async def _measure(
    config: dict[str, Any], latency_ms: float, in_flight: int, rollouts: int
) -> dict[str, Any]:
    async with RolloutCollectionHelper(config, max_connections=in_flight) as helper:
        await _drive(helper, in_flight, 0, in_flight)  # warm-up: opens the connections
        cpu0 = time.process_time()
        done, wall_s, steady = await _drive(helper, rollouts, in_flight, in_flight)
        cpu_s = time.process_time() - cpu0
    inner = config["bench_env"]["environment_servers"]["example_env"]
    bare_done, bare_wall_s = await _bare_loop(
        f"http://{inner['host']}:{inner['port']}/run", rollouts, in_flight, in_flight
    )
    if done != rollouts or bare_done != rollouts:
        raise RuntimeError(f"latency bench finished {done} (bare loop: {bare_done}) of {rollouts} rollouts")
    ideal = in_flight / (latency_ms / 1000.0)
    measured = rollouts / wall_s
    return {
        "latency_ms": latency_ms,
        "in_flight": in_flight,
        "rollouts": rollouts,
        "wall_s": wall_s,
        "ideal_wall_s": rollouts / ideal,
        "rollouts_per_s": measured,
        "ideal_rollouts_per_s": ideal,
        "efficiency": measured / ideal,
        "steady_rollouts_per_s": steady,
        "steady_efficiency": steady / ideal if steady is not None else None,
        "client_cpu_us_per_rollout": cpu_s / rollouts * 1e6,
        "bare_aiohttp_rollouts_per_s": rollouts / bare_wall_s,
        "bare_aiohttp_efficiency": rollouts / bare_wall_s / ideal,
    }


def run_latency_bench(latency_ms: float = 500, in_flight: int = 256, rollouts: int = 2560) -> dict[str, Any]:
    """Measure ``run_examples`` throughput against a fixed-latency server versus ``in_flight / latency``.

    Args:
        latency_ms: The server's delay per ``/run`` (no jitter).
        in_flight: ``max_resident_tasks`` and the connector ``limit``.
        rollouts: Rows in the measured run (after a warm-up of ``in_flight`` rows).

    Returns:
        ``{"latency_ms", "in_flight", "rollouts", "wall_s", "ideal_wall_s", "rollouts_per_s",
        "ideal_rollouts_per_s", "efficiency", "steady_rollouts_per_s", "steady_efficiency",
        "client_cpu_us_per_rollout", "bare_aiohttp_rollouts_per_s", "bare_aiohttp_efficiency"}``; also
        printed. ``efficiency`` is over the whole measured run (first wave's ramp and last wave's tail
        included); ``steady_efficiency`` over its middle half.

    Raises:
        UsageError: a non-positive argument.
        RuntimeError: the server did not start, or rollouts were lost.
    """
    if latency_ms <= 0 or in_flight < 1 or rollouts < 1:
        raise UsageError(
            f"latency_ms={latency_ms!r}, in_flight={in_flight!r}, rollouts={rollouts!r}: "
            "all three must be positive"
        )
    with serve_bench_server(latency_config(latency_ms)) as config:
        result = asyncio.run(_measure(config, latency_ms, in_flight, rollouts))
    print(
        f"latency bench: latency={latency_ms:g} ms in_flight={in_flight} rollouts={rollouts} "
        f"{result['rollouts_per_s']:.1f}/s of ideal {result['ideal_rollouts_per_s']:.1f}/s "
        f"efficiency={result['efficiency']:.4f} steady={result['steady_efficiency'] or 0.0:.4f} "
        f"(bare aiohttp: {result['bare_aiohttp_efficiency']:.4f})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 500.0
    counts = [int(a) for a in sys.argv[2:4]]
    run_latency_bench(latency, *counts)

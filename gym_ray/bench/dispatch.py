"""Benchmark: collector CPU per rollout of ``run_examples`` versus a bare aiohttp loop.

The reference environment server runs in instant mode (``latency_ms: 0``) in a *separate process*, so
``time.process_time()`` in this process measures only the client side. Both loops use the same server,
the same concurrency and the same session limits (connector ``limit`` = concurrency, the same
``ClientTimeout``), and run one after the other in the same invocation (each after a short warm-up).

Run: ``python -m gym_ray.bench.dispatch [n] [concurrency]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import aiohttp

from gym_ray.dispatch.helper import RolloutCollectionHelper

_WARMUP_ROWS = 500


def bench_config() -> dict[str, Any]:
    """One instant ``example_env`` environment server fronting one ``example_env`` agent."""
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "bench_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "bench_env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "latency_ms": 0,
                    "latency_jitter_ms": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "bench_agent"},
                }
            }
        },
    }


def bench_rows(n: int, offset: int = 0) -> Iterator[dict[str, Any]]:
    """``n`` bench rows (task indices ``offset..offset+n-1``), produced lazily: never a list."""
    for i in range(offset, offset + n):
        yield {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i % 97} + 3?"}]},
            "expected_answer": str(i % 97 + 3),
            "agent_ref": {"name": "bench_agent"},
            "_ng_task_index": i,
            "_ng_rollout_index": 0,
        }


def _serve(conn: Connection, config: dict[str, Any]) -> None:
    from gym_ray.servers import serve_config

    async def main() -> None:
        async with serve_config(config) as dep:
            conn.send(dep.config)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(main())


async def _bare_loop(url: str, n: int, concurrency: int) -> int:
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, keepalive_timeout=15.0)
    timeout = aiohttp.ClientTimeout(total=900.0, connect=10.0, sock_connect=10.0)
    headers = {"Content-Type": "application/json"}
    rows = bench_rows(n)
    done = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:

        async def worker() -> None:
            nonlocal done
            for row in rows:
                async with session.post(url, data=json.dumps(row).encode(), headers=headers) as resp:
                    resp.raise_for_status()
                    json.loads(await resp.read())
                done += 1

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())
    return done


async def run_examples_loop(config: dict[str, Any], n: int, concurrency: int) -> int:
    """Consume ``n`` bench rows through ``run_examples`` with ``max_resident_tasks=concurrency``."""
    done = 0
    async with RolloutCollectionHelper(config, max_connections=concurrency) as helper:
        completions = helper.run_examples(bench_rows(n), max_resident_tasks=concurrency)
        try:
            async for _row, _result in completions:
                done += 1
        finally:
            await completions.aclose()
    return done


async def _measure(config: dict[str, Any], n: int, concurrency: int) -> dict[str, Any]:
    url = _env_url(config) + "/run"
    await _bare_loop(url, _WARMUP_ROWS, concurrency)
    await run_examples_loop(config, _WARMUP_ROWS, concurrency)
    out: dict[str, Any] = {"n": n, "concurrency": concurrency}
    loops: list[tuple[str, Callable[[], Awaitable[int]]]] = [
        ("bare_aiohttp", lambda: _bare_loop(url, n, concurrency)),
        ("run_examples", lambda: run_examples_loop(config, n, concurrency)),
    ]
    for name, run in loops:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        count = await run()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        if count != n:
            raise RuntimeError(f"{name} finished {count} of {n} rollouts")
        out[name] = {
            "cpu_us_per_rollout": cpu / n * 1e6,
            "wall_s": wall,
            "rollouts_per_s": n / wall,
        }
    out["cpu_ratio"] = out["run_examples"]["cpu_us_per_rollout"] / out["bare_aiohttp"]["cpu_us_per_rollout"]
    return out


@contextlib.contextmanager
def serve_bench_server(config: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Run a reference server (default: the instant one) in a separate process; yields its config.

    Raises:
        RuntimeError: the server exited, or did not report its ports within 60 s.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child, config or bench_config()), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 60.0
        while not parent.poll(0.2):
            if not server.is_alive():
                raise RuntimeError(
                    f"the benchmark's reference server exited with code {server.exitcode} before it "
                    "started; see its traceback above"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's reference server did not start within 60 s")
        yield parent.recv()
    finally:
        parent.send("stop")
        server.join(10)
        if server.is_alive():
            server.terminate()
            server.join(5)


def _env_url(config: dict[str, Any]) -> str:
    inner = config["bench_env"]["environment_servers"]["example_env"]
    return f"http://{inner['host']}:{inner['port']}"


def run_dispatch_bench(n: int = 20000, concurrency: int = 256) -> dict[str, Any]:
    """Measure collector CPU per rollout: ``run_examples`` vs a bare aiohttp loop, same server and limits.

    Args:
        n: Rollouts per loop.
        concurrency: Requests in flight (``max_resident_tasks`` / worker count / connector limit).

    Returns:
        ``{"n", "concurrency", "bare_aiohttp": {...}, "run_examples": {...}, "cpu_ratio"}`` where each
        loop reports ``cpu_us_per_rollout``, ``wall_s`` and ``rollouts_per_s``; also printed.
    """
    with serve_bench_server() as config:
        result = asyncio.run(_measure(config, n, concurrency))
    print(
        f"dispatch bench: n={n} concurrency={concurrency} "
        f"bare={result['bare_aiohttp']['cpu_us_per_rollout']:.0f} us/rollout "
        f"run_examples={result['run_examples']['cpu_us_per_rollout']:.0f} us/rollout "
        f"ratio={result['cpu_ratio']:.2f}"
    )
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    run_dispatch_bench(*args)

"""Benchmark: with slow environment servers, bounded dispatch keeps every slot busy.

The reference environment server answers each ``/run`` after a fixed delay (``latency_ms``, no jitter)
and runs in a *separate process*. ``run_examples`` drives it with ``max_resident_tasks = in_flight`` (and
the connector ``limit`` equal to it). The ideal throughput is ``in_flight / latency``: 256 slots of
500 ms give 512 rollouts/s. The figure reported is the efficiency, measured over ideal (target >= 0.98):
what the collector loses between one rollout finishing and the next one being on the wire.

A warm-up of ``in_flight`` rows opens the connections first; the measured run reuses the helper, so its
figure excludes connection set-up but includes the first wave's ramp and the last wave's tail. The same
rows then go through a bare aiohttp loop (``in_flight`` coroutines POSTing back to back, same limits):
its efficiency is what the server and the machine allow, so the gap between the two is the collector's
(``collector_vs_bare`` = efficiency / bare efficiency). When the ``wrk`` load generator is on ``PATH``, it
drives the same server with ``in_flight`` connections for about ``rollouts / ideal`` seconds (at least
5 s), POSTing one bench row: a C client, so its rate is the server's and the machine's own ceiling.
Without ``wrk`` the ``wrk_*`` figures are None.

Run: ``python -m gym_ray.bench.latency [latency_ms] [in_flight] [rollouts]``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gym_ray.bench.dispatch import bench_config, bench_rows, serve_bench_server
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.errors import UsageError


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


#: ``(url, rows)``: ``rows(n, offset)`` yields ``n`` rows (task indices from ``offset``) to POST to ``url``.
BareTarget = tuple[str, Callable[[int, int], Iterator[dict[str, Any]]]]


async def bare_aiohttp_loop(
    targets: Sequence[BareTarget], n: int, offset: int, in_flight: int
) -> tuple[int, float]:
    """The baseline: ``in_flight`` plain aiohttp loops POSTing rows back to back, one session.

    The loops and the rows are split evenly over ``targets`` (the first targets take any remainder); each
    target's loops share one row iterator. The connector ``limit`` is ``in_flight``. A warm-up of
    ``in_flight`` rows (task indices ``0..in_flight-1``) opens the connections first and is not timed.

    Args:
        targets: Where to POST and which rows (at least one; no more than ``in_flight``).
        n: Rows in the timed run (task indices from ``offset``).
        offset: First task index of the timed run.
        in_flight: Concurrent loops, and the connector limit.

    Returns:
        (rows completed in the timed run, its wall seconds).

    Raises:
        UsageError: no targets, more targets than ``in_flight``, or a negative count.
        aiohttp.ClientError: a request failed or answered an error status.
    """
    if not targets or len(targets) > in_flight or n < 0 or offset < 0:
        raise UsageError(
            f"bare_aiohttp_loop: targets={len(targets)}, in_flight={in_flight}, n={n}, offset={offset}: "
            "give 1..in_flight targets and non-negative counts"
        )
    connector = aiohttp.TCPConnector(limit=in_flight, limit_per_host=0, keepalive_timeout=15.0)
    timeout = aiohttp.ClientTimeout(total=900.0, connect=10.0, sock_connect=10.0)
    headers = {"Content-Type": "application/json"}
    done = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:

        async def loop(url: str, rows: Iterator[dict[str, Any]]) -> None:
            nonlocal done
            for row in rows:
                async with session.post(url, data=json.dumps(row).encode(), headers=headers) as resp:
                    resp.raise_for_status()
                    json.loads(await resp.read())
                done += 1

        async def run(count: int, first: int) -> float:
            started = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for index, (url, make_rows) in enumerate(targets):
                    rows = make_rows(_share(count, len(targets), index), first)
                    first += _share(count, len(targets), index)
                    for _ in range(_share(in_flight, len(targets), index)):
                        tg.create_task(loop(url, rows))
            return time.perf_counter() - started

        await run(in_flight, 0)  # warm-up: opens the connections
        done = 0
        wall_s = await run(n, offset)
    return done, wall_s


def _share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split evenly over ``parts`` (the first parts take the remainder)."""
    return total // parts + (1 if index < total % parts else 0)


async def _bare_loop(url: str, n: int, offset: int, in_flight: int) -> tuple[int, float]:
    """:func:`bare_aiohttp_loop` against one server with bench rows."""
    return await bare_aiohttp_loop([(url, bench_rows)], n, offset, in_flight)


_WRK_RATE = re.compile(r"^Requests/sec:\s+([0-9.]+)\s*$", re.MULTILINE)
_WRK_LATENCY = re.compile(r"^\s*Latency\s+([0-9.]+)(us|ms|s|m|h)\b", re.MULTILINE)
_WRK_NON_2XX = re.compile(r"^\s*Non-2xx or 3xx responses:\s+(\d+)", re.MULTILINE)
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def parse_wrk_output(text: str) -> tuple[float, float]:
    """Read ``Requests/sec`` and the thread-stats latency average (in ms) from ``wrk --latency`` output.

    Raises:
        RuntimeError: a figure is missing, or wrk counted non-2xx/3xx replies (the rate would count
            errors as rollouts).
    """
    rate, latency = _WRK_RATE.search(text), _WRK_LATENCY.search(text)
    if rate is None or latency is None:
        raise RuntimeError(f"wrk output has no Requests/sec or Latency line: {text[-2000:]!r}")
    errors = _WRK_NON_2XX.search(text)
    if errors is not None and int(errors.group(1)):
        raise RuntimeError(f"wrk got {errors.group(1)} non-2xx/3xx replies; output: {text[-2000:]!r}")
    return float(rate.group(1)), float(latency.group(1)) * _UNIT_MS[latency.group(2)]


def wrk_script(body: str) -> str:
    """A wrk Lua script POSTing ``body`` as JSON (the body in a Lua long string, never escaped)."""
    level = 0
    while f"]{'=' * level}]" in body:
        level += 1
    eq = "=" * level
    return (
        'wrk.method = "POST"\n'
        f"wrk.body = [{eq}[{body}]{eq}]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )


def run_wrk(
    wrk: str, url: str, body: str, in_flight: int, seconds: int, timeout_s: float
) -> tuple[float, float]:
    """Run ``wrk -t1 -c<in_flight> -d<seconds>s --latency`` POSTing ``body`` to ``url``.

    Returns:
        (requests/s, average latency in ms).

    Raises:
        RuntimeError: wrk failed, ran over ``seconds + 60``, or its output lacks a figure.
    """
    with tempfile.TemporaryDirectory(prefix="gym-ray-wrk-") as folder:
        script = Path(folder) / "post.lua"
        script.write_text(wrk_script(body), encoding="utf-8")
        command = [
            wrk,
            "-t1",
            f"-c{in_flight}",
            f"-d{seconds}s",
            f"--timeout={max(2, int(timeout_s + 1))}s",
            "--latency",
            "-s",
            str(script),
            url,
        ]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{' '.join(command)} ran over {seconds + 60} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return parse_wrk_output(proc.stdout)


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
        "collector_vs_bare": rollouts / wall_s / (rollouts / bare_wall_s),
    }


def _wrk_figures(config: dict[str, Any], latency_ms: float, in_flight: int, rollouts: int) -> dict[str, Any]:
    """The ``wrk_*`` figures against the bench server (all None when ``wrk`` is not on PATH)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"wrk_rollouts_per_s": None, "wrk_efficiency": None, "wrk_latency_avg_ms": None}
    ideal = in_flight / (latency_ms / 1000.0)
    inner = config["bench_env"]["environment_servers"]["example_env"]
    rate, latency_avg_ms = run_wrk(
        wrk,
        f"http://{inner['host']}:{inner['port']}/run",
        json.dumps(next(bench_rows(1))),
        in_flight,
        max(5, round(rollouts / ideal)),
        timeout_s=max(2.0, 4 * latency_ms / 1000.0),
    )
    return {"wrk_rollouts_per_s": rate, "wrk_efficiency": rate / ideal, "wrk_latency_avg_ms": latency_avg_ms}


def run_latency_bench(latency_ms: float = 500, in_flight: int = 256, rollouts: int = 2560) -> dict[str, Any]:
    """Measure ``run_examples`` throughput against a fixed-latency server versus ``in_flight / latency``.

    Args:
        latency_ms: The server's delay per ``/run`` (no jitter).
        in_flight: ``max_resident_tasks`` and the connector ``limit``.
        rollouts: Rows in the measured run (after a warm-up of ``in_flight`` rows).

    Returns:
        ``{"latency_ms", "in_flight", "rollouts", "wall_s", "ideal_wall_s", "rollouts_per_s",
        "ideal_rollouts_per_s", "efficiency", "steady_rollouts_per_s", "steady_efficiency",
        "client_cpu_us_per_rollout", "bare_aiohttp_rollouts_per_s", "bare_aiohttp_efficiency",
        "collector_vs_bare", "wrk_rollouts_per_s", "wrk_efficiency", "wrk_latency_avg_ms"}``; also
        printed. ``efficiency`` is over the whole measured run (first wave's ramp and last wave's tail
        included); ``steady_efficiency`` over its middle half; ``collector_vs_bare`` is ``efficiency``
        over ``bare_aiohttp_efficiency``. The ``wrk_*`` figures come from ``wrk`` (``in_flight``
        connections, one thread, about ``rollouts / ideal`` seconds, at least 5) and are None when
        ``wrk`` is not on ``PATH``.

    Raises:
        UsageError: a non-positive argument.
        RuntimeError: the server did not start, rollouts were lost, or ``wrk`` failed.
    """
    if latency_ms <= 0 or in_flight < 1 or rollouts < 1:
        raise UsageError(
            f"latency_ms={latency_ms!r}, in_flight={in_flight!r}, rollouts={rollouts!r}: "
            "all three must be positive"
        )
    with serve_bench_server(latency_config(latency_ms)) as config:
        result = asyncio.run(_measure(config, latency_ms, in_flight, rollouts))
        result.update(_wrk_figures(config, latency_ms, in_flight, rollouts))
    wrk = (
        "wrk: not on PATH"
        if result["wrk_efficiency"] is None
        else f"wrk: {result['wrk_rollouts_per_s']:.1f}/s efficiency={result['wrk_efficiency']:.4f} "
        f"avg latency {result['wrk_latency_avg_ms']:.1f} ms"
    )
    print(
        f"latency bench: latency={latency_ms:g} ms in_flight={in_flight} rollouts={rollouts} "
        f"{result['rollouts_per_s']:.1f}/s of ideal {result['ideal_rollouts_per_s']:.1f}/s "
        f"efficiency={result['efficiency']:.4f} steady={result['steady_efficiency'] or 0.0:.4f} "
        f"(bare aiohttp: {result['bare_aiohttp_efficiency']:.4f}, "
        f"collector/bare={result['collector_vs_bare']:.4f}; {wrk})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    latency = float(sys.argv[1]) if len(sys.argv) > 1 else 500.0
    counts = [int(a) for a in sys.argv[2:4]]
    run_latency_bench(latency, *counts)

"""``gym-ray bench ray``: figures of the distributed layer against the reference servers.

Scenarios (each starts its own reference servers on 127.0.0.1 and a fresh run folder):

- ``startup``: time from calling the run to the first ``/run`` a server receives, and to the last reply.
- ``efficiency``: latency-bound throughput. ``num_workers`` workers with ``in_flight_total`` rollouts in
  flight in total against servers answering in ``latency_ms``; the ideal rate is
  ``in_flight_total / latency``. Efficiency = rate measured between the first ``/run`` and the last reply,
  divided by the ideal. In the same invocation, after the Ray run, a bare aiohttp loop in this process
  (``in_flight_total`` coroutines POSTing rows back to back, split evenly over the environment servers;
  a warm-up of ``in_flight_total`` rows, then ``efficiency_rollouts`` timed) measures the ceiling that
  the servers and the machine allow: ``bare_aiohttp_efficiency``, and ``ray_vs_bare`` = efficiency over it.
  That loop is one Python process, so it can be slower than several Ray workers; when ``wrk`` is on
  ``PATH``, one ``wrk`` per server (a C client, ``in_flight_total`` connections split evenly, about
  ``efficiency_rollouts / ideal`` seconds, at least 5) gives the servers' own ceiling: ``wrk_efficiency``
  and ``ray_vs_wrk`` (None without ``wrk``).
- ``rss``: peak resident memory of the driver actor, the coordinator actor and each worker actor, and
  their sum (``actors_peak_rss_mb``, each actor's own peak: an upper bound of the tree's), for two input
  sizes (instant servers, input read from a JSONL file), sampled every
  ``sample_s``; flat peaks mean memory does not grow with the input.

The reference servers run in a child process (spawned, one per scenario run), so they do not share this
process's interpreter lock with the sampler and the bare loop. The sampler reads their ``/run`` counters
over a pipe (two integers per server, no request-count tables).

Uses the Ray this process runs, else starts a local one (and stops it). Figures depend on the machine:
they are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from gym_ray import keys
from gym_ray.bench.latency import BareTarget, _share, bare_aiohttp_loop, run_wrk
from gym_ray.config.run_config import resolve_run_config
from gym_ray.distributed.api import RunActors, plan_from_config, run_actors
from gym_ray.distributed.placement import ray_connection
from gym_ray.servers import ServerStats, load_bundled_config
from gym_ray.servers.datagen import arithmetic_rows, write_jsonl

ENVS = ("arith_env", "arith_env_hard")
#: The agent each environment server fronts (``_input_file``: even rows to the first, odd to the second).
AGENTS = ("arith_agent", "arith_agent_hard")


@dataclass
class _Probe:
    """What the sampler saw during one run."""

    first_request_s: float | None = None
    last_completion_s: float | None = None
    peak_rss: dict[str, int] = field(default_factory=dict)


def _servers_config(latency_ms: float) -> dict[str, Any]:
    cfg = load_bundled_config()
    for env in ENVS:
        cfg[env]["environment_servers"]["example_env"].update(latency_ms=latency_ms, latency_jitter_ms=0)
    return cfg


def _serve_counting(conn: Connection, config: dict[str, Any]) -> None:
    """Child process: serve ``config``, send its live config, then answer counter queries until "stop"."""
    from gym_ray.servers import serve_config

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with serve_config(config) as deployment:
            conn.send(deployment.config)
            while True:
                try:
                    name = await loop.run_in_executor(None, conn.recv)
                except EOFError:  # the bench process is gone
                    return
                if name == "stop":
                    return
                stats = deployment.servers[name].stats  # read on the servers' loop: no lock needed
                conn.send((stats.requests, stats.completed))

    asyncio.run(main())


class _ProcessServers:
    """Reference servers in a child process: the live ``config`` and ``stats(name)`` (requests, completed)."""

    def __init__(self, conn: Connection, config: dict[str, Any]) -> None:
        self.config = config
        self._conn = conn
        self._lock = threading.Lock()

    def stats(self, name: str) -> ServerStats:
        """``requests`` and ``completed`` of instance ``name`` (the other counters are left at zero)."""
        with self._lock:
            self._conn.send(name)
            requests, completed = self._conn.recv()
        return ServerStats(requests=requests, completed=completed)

    def stop(self) -> None:
        """Ask the child to stop serving (after any query in progress)."""
        with self._lock, contextlib.suppress(OSError):
            self._conn.send("stop")


@contextlib.contextmanager
def _servers_in_process(config: dict[str, Any]) -> Iterator[_ProcessServers]:
    """Run ``serve_config(config)`` in a spawned child process until the block exits.

    Raises:
        RuntimeError: the child exited, or did not report its ports within 60 s.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve_counting, args=(child, config), daemon=True)
    server.start()
    child.close()  # the child holds its own copy; closing ours lets either side see EOF
    servers: _ProcessServers | None = None
    try:
        deadline = time.monotonic() + 60.0
        while not parent.poll(0.2):
            if not server.is_alive():
                raise RuntimeError(
                    f"the reference servers' process exited with code {server.exitcode} before they "
                    "started; see its traceback above"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the reference servers did not start within 60 s")
        servers = _ProcessServers(parent, parent.recv())
        yield servers
    finally:
        if servers is not None:
            servers.stop()
        else:
            with contextlib.suppress(OSError):
                parent.send("stop")
        server.join(10)
        if server.is_alive():
            server.terminate()
            server.join(5)
        parent.close()


def _env_rows(agent: str, n: int, offset: int) -> Iterator[dict[str, Any]]:
    """``n`` flat arithmetic rows for the server fronting ``agent`` (task indices from ``offset``)."""
    for index, row in enumerate(arithmetic_rows(offset + n, agent=agent)[offset:], start=offset):
        row[keys.TASK_INDEX] = index
        row[keys.ROLLOUT_INDEX] = 0
        yield row


async def _bare_ceiling(config: dict[str, Any], in_flight_total: int, rollouts: int) -> tuple[int, float]:
    """:func:`gym_ray.bench.latency.bare_aiohttp_loop` over the ``ENVS`` servers of the live ``config``.

    Returns:
        (rows completed in the timed run, its wall seconds); the warm-up is ``in_flight_total`` rows.
    """
    targets: list[BareTarget] = []
    for env, agent in zip(ENVS, AGENTS, strict=True):
        inner = config[env][keys.ENVIRONMENT_SERVERS]["example_env"]
        targets.append((f"http://{inner['host']}:{inner['port']}/run", functools.partial(_env_rows, agent)))
    return await bare_aiohttp_loop(targets, rollouts, in_flight_total, in_flight_total)


async def _wrk_ceiling(
    config: dict[str, Any], in_flight_total: int, seconds: int, latency_ms: float
) -> float | None:
    """Requests/s of one ``wrk`` per ``ENVS`` server at once (``in_flight_total`` connections split evenly).

    Returns:
        The summed rate, or None when ``wrk`` is not on ``PATH``.

    Raises:
        RuntimeError: a wrk run failed (see :func:`gym_ray.bench.latency.run_wrk`).
    """
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    runs = []
    for index, (env, agent) in enumerate(zip(ENVS, AGENTS, strict=True)):
        inner = config[env][keys.ENVIRONMENT_SERVERS]["example_env"]
        url = f"http://{inner['host']}:{inner['port']}/run"
        body = json.dumps(next(_env_rows(agent, 1, 0)))
        connections = max(1, _share(in_flight_total, len(ENVS), index))
        runs.append(
            asyncio.to_thread(
                run_wrk, wrk, url, body, connections, seconds, max(2.0, 4 * latency_ms / 1000.0)
            )
        )
    rates = await asyncio.gather(*runs)
    return sum(rate for rate, _latency_ms in rates)


def _input_file(folder: Path, rows: int) -> Path:
    path = folder / f"input_{rows}.jsonl"
    data = arithmetic_rows(rows)
    for index, row in enumerate(data):
        row["row_number"] = index  # distinct rows, so each is its own task
        if index % 2:
            row["agent_ref"] = {"name": AGENTS[1]}
    write_jsonl(data, path)
    return path


async def _pids(actors: RunActors) -> dict[str, int]:
    pids = {
        "driver": await actors.driver.pid.remote(),
        "coordinator": await actors.coordinator.pid.remote(),
    }
    for worker_id, handle in list(actors.workers.items()):
        with contextlib.suppress(Exception):
            pids[worker_id] = await handle.pid.remote()
    return pids


async def _sample(
    servers: _ProcessServers,
    planned: int,
    started: float,
    probe: _Probe,
    pids: dict[str, int],
    every_s: float,
) -> None:
    while True:
        stats = await asyncio.to_thread(lambda: [servers.stats(env) for env in ENVS])
        now = time.monotonic() - started
        if probe.first_request_s is None and sum(s.requests for s in stats) > 0:
            probe.first_request_s = now
        if probe.last_completion_s is None and sum(s.completed for s in stats) >= planned:
            probe.last_completion_s = now
        for name, pid in pids.items():
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss
                probe.peak_rss[name] = max(probe.peak_rss.get(name, 0), rss)
        await asyncio.sleep(every_s)


async def _run(
    servers: _ProcessServers,
    *,
    latency_ms: float,
    rows: int,
    folder: Path,
    num_workers: int,
    max_resident_tasks: int,
    shard_size: int,
    sample_s: float,
) -> tuple[dict[str, Any], _Probe]:
    """One distributed run of ``rows`` rows against ``servers``; the run figures and what the sampler saw."""
    input_path = _input_file(folder, rows)
    probe = _Probe()
    run_config = await resolve_run_config(
        servers.config,
        settings={
            "input_jsonl_fpath": str(input_path),
            "output_dir": str(folder / f"run_{rows}_{latency_ms:g}"),
            "shard_size": shard_size,
            "max_resident_tasks": max_resident_tasks,
        },
    )
    pids: dict[str, int] = {}
    started = time.monotonic()
    sampler = asyncio.ensure_future(_sample(servers, rows, started, probe, pids, sample_s))
    actors: list[RunActors] = []
    ready = asyncio.Event()

    def on_started(live: RunActors) -> None:
        actors.append(live)
        ready.set()

    run = asyncio.ensure_future(
        run_actors(
            run_config,
            functools.partial(plan_from_config, run_config, None),
            run_dir=str(folder / f"run_{rows}_{latency_ms:g}"),
            num_workers=num_workers,
            started_at=started,
            on_started=on_started,
        )
    )
    waiter = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({run, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if actors:
            pids.update(await _pids(actors[0]))
        result = await run
    finally:
        for task in (run, sampler, waiter):
            task.cancel()
        await asyncio.gather(run, sampler, waiter, return_exceptions=True)
    figures = {
        "rows": rows,
        "succeeded": result.succeeded,
        "failed": result.failed,
        "wall_s": round(result.wall_s, 3),
        "rollouts_per_s": round(result.rollouts_per_s, 1),
    }
    return figures, probe


async def run_ray_bench(
    *,
    num_workers: int = 4,
    latency_ms: float = 500.0,
    in_flight_total: int = 1024,
    efficiency_rollouts: int = 8192,
    rss_sizes: Sequence[int] = (2000, 20000),
    sample_s: float = 0.05,
    folder: str | None = None,
) -> dict[str, Any]:
    """Run the three scenarios and return their figures (see the module docstring).

    Args:
        num_workers: Worker actors.
        latency_ms: Server latency of the efficiency scenario.
        in_flight_total: Rollouts in flight over all workers (``max_resident_tasks`` = this / workers).
        efficiency_rollouts: Rollouts in the efficiency scenario.
        rss_sizes: The two input sizes (rows) of the memory scenario.
        sample_s: Sampling period of server stats and process memory.
        folder: Where run folders go (default: a temporary folder, removed afterwards).

    Returns:
        ``{"startup": {...}, "efficiency": {...}, "rss": [...]}``. ``efficiency`` also holds the
        bare-loop ceiling: ``bare_aiohttp_rollouts_per_s``, ``bare_aiohttp_efficiency`` and
        ``ray_vs_bare`` (``efficiency`` over ``bare_aiohttp_efficiency``); and, when ``wrk`` is on
        ``PATH`` (else None), ``wrk_rollouts_per_s``, ``wrk_efficiency`` and ``ray_vs_wrk``.

    Raises:
        RuntimeError: the reference servers did not start, the bare loop lost rollouts, or wrk failed.
    """
    with contextlib.ExitStack() as stack:
        root = Path(folder) if folder else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        async with ray_connection(None):
            per_worker = max(1, in_flight_total // num_workers)
            with _servers_in_process(_servers_config(latency_ms)) as servers:
                figures, probe = await _run(
                    servers,
                    latency_ms=latency_ms,
                    rows=efficiency_rollouts,
                    folder=root,
                    num_workers=num_workers,
                    max_resident_tasks=per_worker,
                    shard_size=max(1, efficiency_rollouts // (4 * num_workers)),
                    sample_s=min(sample_s, 0.02),
                )
                bare_done, bare_wall_s = await _bare_ceiling(
                    servers.config, per_worker * num_workers, efficiency_rollouts
                )
                ideal = per_worker * num_workers / (latency_ms / 1000.0)
                wrk_rate = await _wrk_ceiling(
                    servers.config,
                    per_worker * num_workers,
                    max(5, round(efficiency_rollouts / ideal)),
                    latency_ms,
                )
            if bare_done != efficiency_rollouts:
                raise RuntimeError(f"the bare loop finished {bare_done} of {efficiency_rollouts} rollouts")
            window = (probe.last_completion_s or 0.0) - (probe.first_request_s or 0.0)
            rate = figures["succeeded"] / window if window > 0 else 0.0
            bare_rate = bare_done / bare_wall_s
            efficiency = rate / ideal
            bare_efficiency = bare_rate / ideal
            wrk_efficiency = None if wrk_rate is None else wrk_rate / ideal
            report: dict[str, Any] = {
                "startup": {
                    "to_first_run_s": _round(probe.first_request_s),
                    "to_last_reply_s": _round(probe.last_completion_s),
                    "wall_s": figures["wall_s"],
                    "num_workers": num_workers,
                },
                "efficiency": {
                    "num_workers": num_workers,
                    "latency_ms": latency_ms,
                    "in_flight_total": per_worker * num_workers,
                    "rollouts": figures["succeeded"] + figures["failed"],
                    "dispatch_window_s": round(window, 3),
                    "rollouts_per_s": round(rate, 1),
                    "ideal_rollouts_per_s": round(ideal, 1),
                    "efficiency": round(efficiency, 3),
                    "end_to_end_rollouts_per_s": figures["rollouts_per_s"],
                    "bare_aiohttp_rollouts_per_s": round(bare_rate, 1),
                    "bare_aiohttp_efficiency": round(bare_efficiency, 3),
                    "ray_vs_bare": round(efficiency / bare_efficiency, 3) if bare_efficiency else 0.0,
                    "wrk_rollouts_per_s": _round1(wrk_rate),
                    "wrk_efficiency": _round(wrk_efficiency),
                    "ray_vs_wrk": _round(efficiency / wrk_efficiency) if wrk_efficiency else None,
                },
                "rss": [],
            }
            for size in rss_sizes:
                with _servers_in_process(_servers_config(0.0)) as servers:
                    figures, probe = await _run(
                        servers,
                        latency_ms=0.0,
                        rows=size,
                        folder=root,
                        num_workers=num_workers,
                        max_resident_tasks=64,
                        shard_size=250,
                        sample_s=sample_s,
                    )
                workers = {k: v for k, v in probe.peak_rss.items() if k not in ("driver", "coordinator")}
                report["rss"].append(
                    {
                        **figures,
                        "driver_peak_rss_mb": _mb(probe.peak_rss.get("driver", 0)),
                        "coordinator_peak_rss_mb": _mb(probe.peak_rss.get("coordinator", 0)),
                        "actors_peak_rss_mb": _mb(sum(probe.peak_rss.values())),
                        "worker_peak_rss_mb": {k: _mb(v) for k, v in sorted(workers.items())},
                        "worker_peak_rss_max_mb": _mb(max(workers.values(), default=0)),
                    }
                )
    return report


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _round1(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _mb(value: int) -> float:
    return round(value / 2**20, 1)


def main(argv: Sequence[str] | None = None) -> int:
    """``gym-ray bench ray`` / ``python -m gym_ray.bench.ray_bench``: run, print the figures as JSON."""
    parser = argparse.ArgumentParser(prog="gym-ray bench ray", description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--in-flight-total", type=int, default=1024)
    parser.add_argument("--efficiency-rollouts", type=int, default=8192)
    parser.add_argument("--rss-sizes", type=int, nargs=2, default=[2000, 20000])
    parser.add_argument("--folder", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(
        run_ray_bench(
            num_workers=args.num_workers,
            latency_ms=args.latency_ms,
            in_flight_total=args.in_flight_total,
            efficiency_rollouts=args.efficiency_rollouts,
            rss_sizes=tuple(args.rss_sizes),
            folder=args.folder,
        )
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``gym-ray bench ray``: figures of the distributed layer against the reference servers.

Scenarios (each starts its own reference servers on 127.0.0.1 and a fresh run folder):

- ``startup``: time from calling the run to the first ``/run`` a server receives, and to the last reply.
- ``efficiency``: latency-bound throughput. ``num_workers`` workers with ``in_flight_total`` rollouts in
  flight in total against servers answering in ``latency_ms``; the ideal rate is
  ``in_flight_total / latency``. Efficiency = rate measured between the first ``/run`` and the last reply,
  divided by the ideal.
- ``rss``: peak resident memory of the driver and of each worker actor for two input sizes (instant
  servers, input read from a JSONL file), sampled every ``sample_s``; flat peaks mean memory does not grow
  with the input.

Uses the Ray this process runs, else starts a local one (and stops it). Figures depend on the machine:
they are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from gym_ray.collect import resolve_run_config
from gym_ray.config import RunSettings
from gym_ray.distributed.api import RunActors, _ray_connection, plan_from_config, run_actors
from gym_ray.servers import ThreadedDeployment, load_bundled_config, start_in_thread
from gym_ray.servers.datagen import arithmetic_rows, write_jsonl

ENVS = ("arith_env", "arith_env_hard")


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


def _input_file(folder: Path, rows: int) -> Path:
    path = folder / f"input_{rows}.jsonl"
    data = arithmetic_rows(rows)
    for index, row in enumerate(data):
        row["row_number"] = index  # distinct rows, so each is its own task
        if index % 2:
            row["agent_ref"] = {"name": "arith_agent_hard"}
    write_jsonl(data, path)
    return path


async def _pids(actors: RunActors) -> dict[str, int]:
    pids = {"driver": await actors.driver.pid.remote()}
    for worker_id, handle in list(actors.workers.items()):
        with contextlib.suppress(Exception):
            pids[worker_id] = await handle.pid.remote()
    return pids


async def _sample(
    servers: ThreadedDeployment,
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
    *,
    latency_ms: float,
    rows: int,
    folder: Path,
    num_workers: int,
    max_resident_tasks: int,
    shard_size: int,
    sample_s: float,
) -> tuple[dict[str, Any], _Probe]:
    """One distributed run of ``rows`` rows; returns the run figures and what the sampler saw."""
    input_path = _input_file(folder, rows)
    probe = _Probe()
    with start_in_thread(_servers_config(latency_ms)) as servers:
        cfg = resolve_run_config(
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
                cfg,
                RunSettings.from_config(cfg),
                functools.partial(plan_from_config, cfg, None),
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
        ``{"startup": {...}, "efficiency": {...}, "rss": [...]}``.
    """
    with contextlib.ExitStack() as stack:
        root = Path(folder) if folder else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        async with _ray_connection(None):
            per_worker = max(1, in_flight_total // num_workers)
            figures, probe = await _run(
                latency_ms=latency_ms,
                rows=efficiency_rollouts,
                folder=root,
                num_workers=num_workers,
                max_resident_tasks=per_worker,
                shard_size=max(1, efficiency_rollouts // (4 * num_workers)),
                sample_s=min(sample_s, 0.02),
            )
            window = (probe.last_completion_s or 0.0) - (probe.first_request_s or 0.0)
            ideal = per_worker * num_workers / (latency_ms / 1000.0)
            rate = figures["succeeded"] / window if window > 0 else 0.0
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
                    "efficiency": round(rate / ideal, 3) if ideal else 0.0,
                    "end_to_end_rollouts_per_s": figures["rollouts_per_s"],
                },
                "rss": [],
            }
            for size in rss_sizes:
                figures, probe = await _run(
                    latency_ms=0.0,
                    rows=size,
                    folder=root,
                    num_workers=num_workers,
                    max_resident_tasks=64,
                    shard_size=250,
                    sample_s=sample_s,
                )
                workers = {k: v for k, v in probe.peak_rss.items() if k != "driver"}
                report["rss"].append(
                    {
                        **figures,
                        "driver_peak_rss_mb": _mb(probe.peak_rss.get("driver", 0)),
                        "worker_peak_rss_mb": {k: _mb(v) for k, v in sorted(workers.items())},
                        "worker_peak_rss_max_mb": _mb(max(workers.values(), default=0)),
                    }
                )
    return report


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


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

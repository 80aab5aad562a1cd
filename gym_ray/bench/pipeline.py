"""``gym-ray bench pipeline``: the whole local pipeline against the honest floor, with its CPU by stage.

One invocation, one instant reference server in another process (:func:`serve_bench_server`), one
generated JSONL input of ``rows`` distinct rows (:func:`~gym_ray.bench.collect_memory.write_input`), then
child processes one after the other, each measured from the outside: the floor, gym_ray, the floor
again (the machine may be shared: the cheaper floor run is the one compared, its ``cpu_s_runs`` lists
both):

- **floor**: :mod:`gym_ray.bench._floor`, a bare aiohttp loop with the same concurrency that reads the
  input line by line, POSTs every row to ``/run`` and appends each reply to a JSONL file;
- **gym_ray**: ``gym-ray run --local`` end to end (preflight, planning, dispatch, recording into locked,
  fsynced shards, merge, ``/aggregate_metrics``) on a fresh run folder, with
  :data:`~gym_ray.run.stage_cpu.STAGE_CPU_ENV` set so the run writes its CPU per stage
  (:mod:`gym_ray.run.stage_cpu`).

Each child's CPU (user + system) comes from ``os.wait4`` on it: exact, and including every process it
started and waited for (the merge's sort pool). Its peak resident set size is its own ``VmHWM``, which it
reports (``wait4``'s ``ru_maxrss`` is not used: Linux carries the parent's size at fork across ``exec``).
``cpu_us_per_rollout`` divides the whole command's CPU (interpreter start-up and imports included) by the
rows; ``startup_cpu_s`` is the CPU each child had spent when its work began, so
``work_cpu_us_per_rollout`` leaves start-up out. The stage split holds ``startup`` (interpreter, imports,
argument parsing and config, before the run began), the run's stages, and ``other``: what no stage holds
(preflight, the run's closing counts and summary, the wait for the child processes). Figures depend on
the machine: they are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gym_ray.bench import _floor
from gym_ray.bench.collect_memory import write_input
from gym_ray.bench.dispatch import _env_url, serve_bench_server
from gym_ray.run.result import SUMMARY_FILE
from gym_ray.run.stage_cpu import STAGE_CPU_ENV, STAGES

__all__ = ["measure_child", "run_pipeline_bench"]


def measure_child(command: list[str], *, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run ``command`` to completion; its exact CPU and wall time from ``os.wait4``.

    Returns:
        ``{"wall_s", "cpu_s", "stdout"}`` (``cpu_s`` = user + system of the child and of every process it
        waited for).

    Raises:
        RuntimeError: The command exited non-zero (its last stderr lines are in the message).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if child.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {child.returncode}:\n{tail}")
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "stdout": stdout,
    }


def _measure_floor(command: list[str], env: dict[str, str], cwd: Path, rows: int) -> dict[str, Any]:
    floor = measure_child(command, env=env, cwd=cwd)
    report = json.loads(floor.pop("stdout"))
    if report["done"] != rows:
        raise RuntimeError(f"the floor loop finished {report['done']} of {rows} rows")
    floor["startup_cpu_s"] = round(report["startup_cpu_s"], 3)
    floor["peak_rss_mb"] = round(report["peak_rss_mb"], 1)
    return floor


def _per_rollout(figures: dict[str, Any], rows: int) -> dict[str, Any]:
    figures["cpu_us_per_rollout"] = round(figures["cpu_s"] / rows * 1e6, 1)
    figures["work_cpu_us_per_rollout"] = round((figures["cpu_s"] - figures["startup_cpu_s"]) / rows * 1e6, 1)
    return figures


def run_pipeline_bench(rows: int = 20000, concurrency: int = 256) -> dict[str, Any]:
    """Measure the floor and ``gym-ray run --local`` on the same input and server, in one invocation.

    Args:
        rows: Generated input rows (one rollout each).
        concurrency: Requests in flight for both (the floor's workers; the run's ``max_resident_tasks``
            and ``max_connections``).

    Returns:
        ``{"rows", "concurrency", "floor", "gym_ray", "ratios"}``: each side's ``wall_s``, ``cpu_s``,
        ``startup_cpu_s``, ``cpu_us_per_rollout``, ``work_cpu_us_per_rollout`` and ``peak_rss_mb``;
        ``gym_ray["stages"]`` maps ``startup``, each stage and ``other`` to ``{"cpu_s", "us_per_rollout"}``,
        summing to ``cpu_s``; ``ratios`` gives gym_ray over the floor. A summary is also printed.

    Raises:
        RuntimeError: A child failed, or a side did not finish every row.
    """
    if rows < 1 or concurrency < 1:
        raise ValueError(f"rows and concurrency must be >= 1 (got rows={rows}, concurrency={concurrency})")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", STAGE_CPU_ENV)}
    with tempfile.TemporaryDirectory(prefix="gym-ray-bench-") as tmp, serve_bench_server() as config:
        folder = Path(tmp)
        config_path = folder / "bench.yaml"
        config_path.write_text(yaml.safe_dump(config))
        input_path = folder / "rows.jsonl"
        write_input(input_path, rows)
        url = _env_url(config) + "/run"
        floor_command = [
            sys.executable, _floor.__file__, url, str(input_path), str(folder / "floor.jsonl"),
            str(concurrency),
        ]  # fmt: skip
        floors = [_measure_floor(floor_command, env, folder, rows)]
        stage_file = folder / "stage_cpu.json"
        run_dir = folder / "run"
        run_command = [
            sys.executable, "-m", "gym_ray.cli", "run", str(config_path), f"+input_jsonl_fpath={input_path}",
            f"+output_dir={run_dir}", f"++max_resident_tasks={concurrency}",
            f"++max_connections={concurrency}", "--local", "--progress", "off",
        ]  # fmt: skip
        run = measure_child(run_command, env={**env, STAGE_CPU_ENV: str(stage_file)}, cwd=folder)
        run.pop("stdout")
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        if summary["succeeded"] != rows:
            raise RuntimeError(f"gym-ray run --local recorded {summary['succeeded']} of {rows} rows")
        stage_report = json.loads(stage_file.read_text())
        floors.append(_measure_floor(floor_command, env, folder, rows))
    # The machine may be shared: the floor runs before and after gym-ray, and the cheaper run is the floor.
    floor = min(floors, key=lambda f: f["cpu_s"])
    floor["cpu_s_runs"] = [f["cpu_s"] for f in floors]
    run["startup_cpu_s"] = round(stage_report["process_cpu_at_start_s"], 3)
    run["peak_rss_mb"] = round(stage_report["peak_rss_mb"], 1)
    stages = {"startup": run["startup_cpu_s"], **{name: stage_report["stages"][name] for name in STAGES}}
    stages["other"] = max(0.0, run["cpu_s"] - sum(stages.values()))
    run["stages"] = {
        name: {"cpu_s": round(cpu, 3), "us_per_rollout": round(cpu / rows * 1e6, 1)}
        for name, cpu in stages.items()
    }
    _per_rollout(floor, rows)
    _per_rollout(run, rows)
    result: dict[str, Any] = {
        "rows": rows,
        "concurrency": concurrency,
        "floor": floor,
        "gym_ray": run,
        "ratios": {
            "cpu_per_rollout": round(run["cpu_us_per_rollout"] / floor["cpu_us_per_rollout"], 3),
            "work_cpu_per_rollout": round(
                run["work_cpu_us_per_rollout"] / floor["work_cpu_us_per_rollout"], 3
            ),
            "peak_rss": round(run["peak_rss_mb"] / floor["peak_rss_mb"], 3),
        },
    }
    floor_cpu, run_cpu = floor["cpu_us_per_rollout"], run["cpu_us_per_rollout"]
    split = ", ".join(f"{name} {v['us_per_rollout']:.0f}" for name, v in run["stages"].items())
    print(
        f"pipeline bench: {rows} rows, {concurrency} in flight\n"
        f"  floor:   {floor_cpu:.0f} us/rollout CPU, peak RSS {floor['peak_rss_mb']:.0f} MB\n"
        f"  gym-ray: {run_cpu:.0f} us/rollout CPU, peak RSS {run['peak_rss_mb']:.0f} MB\n"
        f"  ratio run/floor: CPU {result['ratios']['cpu_per_rollout']:.2f}x "
        f"(after start-up {result['ratios']['work_cpu_per_rollout']:.2f}x), "
        f"RSS {result['ratios']['peak_rss']:.2f}x\n"
        f"  gym-ray CPU by stage, us/rollout: {split}",
        flush=True,
    )
    return result

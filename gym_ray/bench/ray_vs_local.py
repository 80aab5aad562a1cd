"""``gym-ray bench ray-vs-local``: what Ray costs over a single-process run: start-up and per rollout.

For each input size (default 2,000 and 20,000 rows), ``gym-ray run --local`` and ``gym-ray run --workers
N`` run as child processes against the same instant reference server (in another process), on fresh run
folders. A sampler walks each child's whole process tree every ``SAMPLE_S`` (the local Ray it starts:
GCS, raylet, agents, every actor) and records:

- ``wall_s``: the child's wall time;
- ``cpu_s``: user + system CPU of every process of the tree (the last sample of each process; a process
  living shorter than one sample interval is missed);
- ``peak_tree_rss_mb``: the largest sum of resident memory over the tree at one sample (shared pages,
  e.g. Ray's object store, count once per process that maps them, so this overstates, never understates);
- ``peak_tree_pss_mb``: the largest sum of proportional set sizes at one sample (each shared page split
  between the processes that map it: what the tree costs the machine; pages shared with processes outside
  the tree, such as another Ray on the same machine, count only in part);
- ``peak_processes``: the most processes the tree had at one sample;
- ``cpu_by_role_s``: ``cpu_s`` split by what each process is (:func:`process_role`): the ``caller`` (the
  ``gym-ray run`` process itself), the run's ``driver`` and ``coordinator`` actors, its ``workers``,
  ``ray`` (Ray's own processes: GCS, raylet, its agents, idle workers) and ``helpers`` (the merge's
  sorting pool, planning's byte-range process). A process is named by its latest sample that shows a
  command line (an exiting one shows none): an actor process shows Ray's worker script until its actor
  renames it.

From two sizes ``a < b`` a straight line ``cost(n) = fixed + n * per_rollout`` is fitted for wall and CPU:
``per_rollout = (cost(b) - cost(a)) / (b - a)`` and ``fixed = cost(a) - a * per_rollout``, so Ray's start-up
and its per-rollout cost are reported apart. The ratios compare Ray with local at the largest size, from
the same invocation. Figures depend on the machine: they are printed, never asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from gym_ray.bench.collect_memory import write_input
from gym_ray.bench.dispatch import serve_bench_server

__all__ = ["ROLES", "measure_tree", "process_role", "run_ray_vs_local_bench"]

#: Seconds between two samples of a child's process tree.
SAMPLE_S = 0.2
_MB = 1024 * 1024
#: The roles of :func:`process_role`, in the order the figures list them.
ROLES = ("caller", "driver", "coordinator", "workers", "ray", "helpers")
#: Ray's own executables (GCS, raylet) by file name.
_RAY_EXECUTABLES = frozenset({"gcs_server", "raylet"})
#: Ray's Python scripts (a worker process before its actor renames it, the two agents) by file name.
_RAY_SCRIPTS = ("default_worker.py", "agent.py", "main.py")


def process_role(cmdline: list[str], *, is_root: bool) -> str:
    """One of :data:`ROLES` for a process of a run's tree, from its command line.

    Ray renames an actor's process ``ray::<Class>`` (``ray::<Class>.<method>`` while a method runs), an idle
    worker ``ray::IDLE`` and its agents ``ray::DashboardAgent`` / ``ray::RuntimeEnvAgent``; before its actor
    renames it, a worker process shows Ray's ``default_worker.py``.
    """
    if is_root:
        return "caller"
    first = cmdline[0] if cmdline else ""
    if first.startswith("ray::"):
        actor = first[len("ray::") :].split(".", 1)[0].split(" ", 1)[0]
        return {"RunDriver": "driver", "RunCoordinator": "coordinator", "RolloutWorker": "workers"}.get(
            actor, "ray"
        )
    if os.path.basename(first) in _RAY_EXECUTABLES or any(
        "/ray/" in part and part.endswith(_RAY_SCRIPTS) for part in cmdline[:3]
    ):
        return "ray"
    return "helpers"


class _TreeSampler:
    """Samples a process tree from a thread: per-process CPU (last seen), peak summed RSS, peak count."""

    def __init__(self, root: int) -> None:
        self._root = root
        self._cpu: dict[int, float] = {}
        self._role: dict[int, str] = {}
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def cpu_s(self) -> float:
        return sum(self._cpu.values())

    def cpu_by_role_s(self) -> dict[str, float]:
        split = dict.fromkeys(ROLES, 0.0)
        for pid, cpu in self._cpu.items():
            split[self._role[pid]] += cpu
        return {role: round(cpu, 3) for role, cpu in split.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)

    def sample(self) -> None:
        try:
            root = psutil.Process(self._root)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = pss = 0
        alive = 0
        for proc in procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    memory = proc.memory_full_info()  # smaps_rollup: PSS as well as RSS
                    cmdline = proc.cmdline()
            except psutil.Error:
                continue
            rss += memory.rss
            pss += getattr(memory, "pss", memory.rss)  # PSS is Linux-only; elsewhere RSS stands in
            alive += 1
            self._cpu[proc.pid] = times.user + times.system
            if cmdline or proc.pid not in self._role:  # an exiting process shows no command line
                self._role[proc.pid] = process_role(cmdline, is_root=proc.pid == self._root)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_processes = max(self.peak_processes, alive)


def measure_tree(command: list[str], *, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run ``command`` to completion and measure its whole process tree (see the module docstring).

    Raises:
        RuntimeError: The command exited non-zero (its last stderr lines are in the message).
    """
    started = time.perf_counter()
    child = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    with _TreeSampler(child.pid) as sampler:
        _, stderr = child.communicate()
    wall = time.perf_counter() - started
    if child.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {child.returncode}:\n{tail}")
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(sampler.cpu_s, 3),
        "peak_tree_rss_mb": round(sampler.peak_rss / _MB, 1),
        "peak_tree_pss_mb": round(sampler.peak_pss / _MB, 1),
        "peak_processes": sampler.peak_processes,
        "cpu_by_role_s": sampler.cpu_by_role_s(),
    }


def _fit(small: dict[str, Any], large: dict[str, Any], a: int, b: int, key: str) -> dict[str, float]:
    per = (large[key] - small[key]) / (b - a)
    return {"fixed_s": round(small[key] - a * per, 3), "per_rollout_us": round(per * 1e6, 1)}


def run_ray_vs_local_bench(sizes: tuple[int, ...] = (2000, 20000), workers: int = 2) -> dict[str, Any]:
    """Run both modes at each size; figures, the start-up / per-rollout split, and the Ray/local ratios."""
    if len(sizes) != 2 or sizes[0] >= sizes[1]:
        raise ValueError(f"give two increasing sizes, e.g. 2000,20000 (got {sizes})")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    figures: dict[str, dict[int, dict[str, Any]]] = {"local": {}, "ray": {}}
    with tempfile.TemporaryDirectory(prefix="gym-ray-bench-") as tmp, serve_bench_server() as config:
        folder = Path(tmp)
        config_path = folder / "bench.yaml"
        config_path.write_text(yaml.safe_dump(config))
        for n in sizes:
            rows = folder / f"rows_{n}.jsonl"
            write_input(rows, n)
            for mode, extra in (("local", ["--local"]), ("ray", ["--workers", str(workers)])):
                command = [
                    sys.executable, "-m", "gym_ray.cli", "run", str(config_path),
                    f"+input_jsonl_fpath={rows}", f"+output_dir={folder / f'{mode}_{n}'}",
                    "++max_resident_tasks=256", *extra,
                ]  # fmt: skip
                figures[mode][n] = measure_tree(command, env=env, cwd=folder)
    a, b = sizes
    result: dict[str, Any] = {"sizes": list(sizes), "workers": workers}
    for mode, by_size in figures.items():
        result[mode] = {
            "runs": {str(n): by_size[n] for n in sizes},
            "wall": _fit(by_size[a], by_size[b], a, b, "wall_s"),
            "cpu": _fit(by_size[a], by_size[b], a, b, "cpu_s"),
        }
    local, ray = figures["local"][b], figures["ray"][b]
    result["ratios_at_largest"] = {
        "wall_ray_over_local": round(ray["wall_s"] / local["wall_s"], 3),
        "cpu_ray_over_local": round(ray["cpu_s"] / local["cpu_s"], 3),
        "per_rollout_cpu_ray_over_local": round(
            result["ray"]["cpu"]["per_rollout_us"] / result["local"]["cpu"]["per_rollout_us"], 3
        ),
        "ray_tree_rss_mb": ray["peak_tree_rss_mb"],
        "ray_tree_pss_mb": ray["peak_tree_pss_mb"],
        "ray_processes": ray["peak_processes"],
    }
    return result

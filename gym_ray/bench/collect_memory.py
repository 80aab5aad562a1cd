"""Benchmark: peak memory of a single-process collection (no Ray) as the number of input rows grows.

For each size, the parent writes a JSONL input file of ``n`` distinct rows (no ``_ng_task_index`` /
``_ng_rollout_index``: preprocessing gives every row its own task by content; ``num_repeats`` 1), then a
*fresh* spawned child process imports the collector, notes its baseline peak resident set size, and runs
the whole :func:`gym_ray.run.collect.acollect_local` on that file: preprocess and validate, plan shards,
dispatch with bounded admission (``max_resident_tasks``), record to shard files, merge, aggregate. The
child reports its own peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), the largest peak of
any process it started and joined (``RUSAGE_CHILDREN``: the merge step's shard-sorting pool, if used),
its wall time and its throughput. The instant reference environment server runs in another process
(:func:`gym_ray.bench.dispatch.serve_bench_server`), so the child's RSS is the collector's alone.

The input is streamed, so the peak should be nearly the same for 100k and 1M rows: the figure reported is
the ratio of the largest to the smallest size's peak. With ``trace_top > 0`` the child also runs
:mod:`tracemalloc` (started after the baseline, so it sees only the collection) and reports the top
allocation sites by ``file:line``, both still held at the end and at the traced peak (a sampler thread
snapshots whenever traced memory has grown by 5 %), to find what grows. Tracing slows the run severalfold
and adds its own memory to the RSS figures.

With ``stage="plan"`` (``gym-ray bench plan-memory``) the child only validates and plans the run folder
(:func:`gym_ray.plan.shards.iter_prepare_run`: both passes over the input, shards written), no servers called:
the figures for the planning stage alone. ``cpu_us_per_rollout`` is then the planning CPU per input row of
the measured process (``children_cpu_s``: the range processes of a parallel validation pass), and
``first_shard_s`` the wall time from the start to the first committed shard (what a worker needs for its
first ``/run``: the whole validation pass plus one shard cut); it is null for ``stage="collect"``.

Each size's run folder and input file live in a temporary folder that is deleted after that size.

Run: ``python -m gym_ray.bench.collect_memory [--trace-top K] [size ...]`` or
``gym-ray bench collect-memory --sizes 100000,1000000``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.bench.child import peak_summary, run_in_child
from gym_ray.bench.dispatch import bench_rows, serve_bench_server
from gym_ray.errors import UsageError

#: ru_maxrss is in KiB on Linux.
_KIB_PER_MB = 1024.0
_BYTES_PER_MB = 1024.0 * 1024.0
#: The tracemalloc sampler snapshots when traced memory exceeds the last snapshot's by this factor.
_TRACE_GROWTH = 1.05
_TRACE_POLL_S = 0.5


def collect_rows(n: int) -> Iterator[dict[str, Any]]:
    """``n`` distinct input rows without task or rollout indices, produced lazily.

    Each row is a :func:`~gym_ray.bench.dispatch.bench_rows` row whose question and answer carry the row
    number (so no two rows share content) and whose ``_ng_task_index`` / ``_ng_rollout_index`` are
    dropped, so preprocessing assigns one task per row.
    """
    for i, row in enumerate(bench_rows(n)):
        row.pop(keys.TASK_INDEX, None)
        row.pop(keys.ROLLOUT_INDEX, None)
        row["responses_create_params"] = {"input": [{"role": "user", "content": f"What is {i} + 3?"}]}
        row["expected_answer"] = str(i + 3)
        yield row


def write_input(path: Path, n: int) -> None:
    """Write :func:`collect_rows` ``(n)`` to ``path`` as JSONL, one row per line."""
    with path.open("w", encoding="utf-8") as out:
        for row in collect_rows(n):
            out.write(json.dumps(row, separators=(",", ":")))
            out.write("\n")


def _peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / _KIB_PER_MB


def _children_cpu_s() -> float:
    """User + system CPU of the processes this one started and joined (planning's range processes,
    the merge step's pool)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _top_sites(snapshot: tracemalloc.Snapshot, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` largest allocation sites of ``snapshot``, by ``file:line``."""
    stats = snapshot.statistics("lineno")[:limit]
    return [
        {
            "site": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
            "size_mb": round(s.size / _BYTES_PER_MB, 3),
            "count": s.count,
        }
        for s in stats
    ]


class _PeakSampler:
    """A thread that keeps the tracemalloc snapshot taken nearest the traced peak.

    Owned by :func:`_child`: started with :meth:`start`, always joined by :meth:`stop`.
    """

    def __init__(self) -> None:
        self.snapshot: tracemalloc.Snapshot | None = None
        self._taken_at = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collect-memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(_TRACE_POLL_S):
            current, _peak = tracemalloc.get_traced_memory()
            if current > self._taken_at * _TRACE_GROWTH:
                self.snapshot = tracemalloc.take_snapshot()
                self._taken_at = current


def _child(
    conn: Connection,
    config: dict[str, Any],
    input_path: str,
    output_dir: str,
    max_resident_tasks: int,
    trace_top: int,
    stage: str = "collect",
) -> None:
    """Body of one measurement process: import, note the baseline peak, collect (or only plan), report."""
    try:
        from gym_ray.config.run_config import RunConfig
        from gym_ray.plan.shards import iter_prepare_run
        from gym_ray.run.collect import acollect_local  # imported before the baseline: counts as baseline

        baseline_mb = _peak_rss_mb()
        sampler = _PeakSampler() if trace_top > 0 else None
        if sampler is not None:
            tracemalloc.start(1)
            sampler.start()
        try:
            started, cpu_started = time.perf_counter(), time.process_time()
            children_started = _children_cpu_s()
            first_shard_s: float | None = None
            if stage == "plan":
                cfg = {**config, "input_jsonl_fpath": input_path, "output_dir": output_dir, "num_repeats": 1}
                planned = succeeded = failed = 0
                for spec in iter_prepare_run(RunConfig.from_dict(cfg)):
                    if first_shard_s is None:  # what a worker needs for its first /run
                        first_shard_s = time.perf_counter() - started
                    planned += spec.num_rows
            else:
                result = asyncio.run(
                    acollect_local(
                        config,
                        progress=False,
                        input_jsonl_fpath=input_path,
                        output_dir=output_dir,
                        num_repeats=1,
                        max_resident_tasks=max_resident_tasks,
                    )
                )
                planned, succeeded, failed = result.planned, result.succeeded, result.failed
            wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
            children_cpu_s = _children_cpu_s() - children_started
        finally:
            if sampler is not None:
                sampler.stop()
        done = planned if stage == "plan" else succeeded
        report: dict[str, Any] = {
            "stage": stage,
            "planned": planned,
            "succeeded": succeeded,
            "failed": failed,
            "baseline_rss_mb": baseline_mb,
            "peak_rss_mb": _peak_rss_mb(),
            "children_peak_rss_mb": _peak_rss_mb(resource.RUSAGE_CHILDREN),
            "wall_s": wall_s,
            "rollouts_per_s": done / wall_s if wall_s > 0 else 0.0,
            "cpu_us_per_rollout": cpu_s / done * 1e6 if done else 0.0,
            "children_cpu_s": children_cpu_s,
            "first_shard_s": first_shard_s,
        }
        if sampler is not None:
            _current, traced_peak = tracemalloc.get_traced_memory()
            report["traced_peak_mb"] = traced_peak / _BYTES_PER_MB
            report["top_retained"] = _top_sites(tracemalloc.take_snapshot(), trace_top)
            report["top_at_peak"] = _top_sites(sampler.snapshot, trace_top) if sampler.snapshot else []
            tracemalloc.stop()
        conn.send(report)
    except Exception:  # reported to the parent, which raises it as a RuntimeError
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def _measure_one(
    config: dict[str, Any], n: int, max_resident_tasks: int, trace_top: int, work_dir: Path, stage: str
) -> dict[str, Any]:
    input_path = work_dir / "input.jsonl"
    output_dir = work_dir / "run"
    write_input(input_path, n)
    report = run_in_child(
        _child,
        (config, str(input_path), str(output_dir), max_resident_tasks, trace_top, stage),
        what=f"{stage}-memory bench child for {n} rows",
        daemon=False,  # the merge step may start its own process pool, which a daemon cannot
    )
    if report["planned"] != n or (stage == "collect" and report["succeeded"] != n):
        raise RuntimeError(
            f"{stage}-memory bench child for {n} rows: {report['succeeded']} succeeded, "
            f"{report['failed']} failed, {report['planned']} planned"
        )
    return {"rows": n, **report}


def run_collect_memory_bench(
    sizes: Sequence[int] = (100_000, 1_000_000),
    max_resident_tasks: int = 256,
    *,
    trace_top: int = 0,
    stage: str = "collect",
) -> dict[str, Any]:
    """Measure a single-process collection's peak RSS for several input sizes, each in a fresh process.

    Args:
        sizes: Row counts; each is written to a JSONL file and collected by ``acollect_local`` in its own
            child process.
        max_resident_tasks: Bounded admission of the run (also its connection limit).
        trace_top: When > 0, run :mod:`tracemalloc` in each child and report this many top allocation
            sites (``top_retained`` at the end, ``top_at_peak`` near the traced peak, ``traced_peak_mb``).

    Returns:
        ``{"max_resident_tasks", "runs": [{"rows", "planned", "succeeded", "failed", "baseline_rss_mb",
        "peak_rss_mb", "children_peak_rss_mb", "wall_s", "rollouts_per_s", "cpu_us_per_rollout",
        "children_cpu_s", "first_shard_s"}, ...], "peak_ratio", "max_peak_rss_mb"}`` where ``peak_ratio``
        is the largest size's peak over the smallest size's peak; also printed. ``cpu_us_per_rollout`` is
        the measured process's own CPU; ``children_cpu_s`` the CPU of the processes it started and joined
        (planning's parallel validation pass over a file of >= 64 MiB, the merge step's pool).
        ``first_shard_s`` (``stage="plan"`` only, else None) is the wall time from the start of planning
        to the first committed shard.

    Raises:
        UsageError: ``sizes`` is empty or holds a count < 1, or ``trace_top`` < 0.
        RuntimeError: the server did not start, or a child failed or did not collect every row.
    """
    if not sizes or min(sizes) < 1:
        raise UsageError(f"sizes={list(sizes)!r}: give one or more row counts, each >= 1")
    if stage not in ("collect", "plan"):
        raise UsageError(f"stage={stage!r}: give 'collect' (the whole run) or 'plan' (planning only)")
    if trace_top < 0:
        raise UsageError(f"trace_top={trace_top!r}: give 0 (no tracing) or a count of sites >= 1")
    runs: list[dict[str, Any]] = []
    with serve_bench_server() as config:
        for n in sizes:
            work_dir = Path(tempfile.mkdtemp(prefix=f"gym_ray_collect_memory_{n}_"))
            try:
                run = _measure_one(config, n, max_resident_tasks, trace_top, work_dir, stage)
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
            runs.append(run)
            print(
                f"{stage}-memory bench: rows={n} peak_rss={run['peak_rss_mb']:.1f} MB "
                f"(baseline {run['baseline_rss_mb']:.1f} MB) wall={run['wall_s']:.1f} s "
                f"{run['rollouts_per_s']:.0f} rollouts/s {run['cpu_us_per_rollout']:.0f} us CPU/rollout "
                f"(+{run['children_cpu_s']:.1f} s in child processes: "
                f"{run['cpu_us_per_rollout'] + run['children_cpu_s'] / n * 1e6:.0f} us CPU per row in all)"
                + (f" first shard {run['first_shard_s']:.2f} s" if run["first_shard_s"] is not None else ""),
                flush=True,
            )
    return peak_summary(f"{stage}-memory bench", runs, max_resident_tasks=max_resident_tasks)


def main(argv: Sequence[str]) -> int:
    """``python -m gym_ray.bench.collect_memory [--trace-top K] [size ...]``; prints the figures as JSON."""
    args = list(argv)
    trace_top = 0
    if args[:1] == ["--trace-top"]:
        if len(args) < 2 or not args[1].isdigit():
            raise UsageError(f"--trace-top needs a count of allocation sites, got {args[1:2]!r}")
        trace_top, args = int(args[1]), args[2:]
    try:
        chosen = [int(a) for a in args] or [100_000, 1_000_000]
    except ValueError as exc:
        raise UsageError(f"sizes {args!r}: give row counts as integers, e.g. 100000 1000000") from exc
    print(json.dumps(run_collect_memory_bench(chosen, trace_top=trace_top), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

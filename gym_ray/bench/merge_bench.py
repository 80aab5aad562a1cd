"""Benchmark: merging a run's shards (``gym_ray.finalize.merge.merge_shards``) -- throughput and peak memory.

``gym-ray bench merge``: writes ``shards`` shard success files holding ``rows`` realistic records (~300 bytes
each: a short prompt, a response summary, reward and the identity keys collection writes), each shard a
contiguous block of tasks (4 rollouts per task) in *shuffled* order, as concurrent rollouts finish, through
the shard writer collection uses (:class:`~gym_ray.record.writer.ShardWriter`, default ``fsync_every``), so
each file has the writer's line index beside it. Then a fresh child process (``python -m
gym_ray.bench.merge_bench --child DIR``) merges them and reports its own peak resident set size, so generating
the input does not pollute the figure. On Linux the peak is the child's ``VmHWM`` (``/proc/self/status``):
``ru_maxrss`` is not used there because Linux carries it across ``fork`` + ``exec``, so a child's
``RUSAGE_SELF`` / the parent's ``RUSAGE_CHILDREN`` would report at least the parent's size at fork time (the
generator's). Elsewhere ``ru_maxrss`` is used.

Targets (issue 5): >= 200k lines/s; peak RSS < 200 MB (memory bounded by one shard, not the run). Issue 17:
>= 500k lines/s for 1M lines.

Run: ``python -m gym_ray.bench.merge_bench [rows [shards]]`` or ``gym-ray bench merge -n 1000000``.
"""

from __future__ import annotations

import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gym_ray import keys

#: ru_maxrss is in KiB on Linux.
_KIB_PER_MB = 1024.0
ROLLOUTS_PER_TASK = 4
_CHILD_TIMEOUT_S = 1800.0


def _record(task: int, rollout: int) -> dict[str, Any]:
    correct = (task * 7 + rollout) % 5 != 0
    return {
        keys.RESPONSES_CREATE_PARAMS: {"input": [{"role": "user", "content": f"What is {task % 997} + 3?"}]},
        keys.RESPONSE: {
            "id": f"r{task:07d}{rollout:02d}",
            keys.USAGE: {"input_tokens": 18, "output_tokens": 9},
        },
        keys.REWARD: 1.0 if correct else 0.0,
        "expected_answer": str(task % 997 + 3),
        keys.TASK_INDEX: task,
        keys.ROLLOUT_INDEX: rollout,
        keys.AGENT_REF: {"name": "bench_agent"},
        keys.ENVIRONMENT_SERVER: "bench_env",
    }


def write_shards(run_dir: Path, rows: int, shards: int, *, seed: int = 0) -> dict[str, int]:
    """Write ``shards`` shard success files of ``rows`` records in total (shuffled within each shard).

    Tasks are cut into contiguous blocks (a task's rollouts stay in one shard, as planning cuts them).

    Returns:
        ``{"rows", "shards", "bytes"}`` as written.
    """
    from gym_ray.record.writer import ShardWriter

    rng = random.Random(seed)
    tasks = -(-rows // ROLLOUTS_PER_TASK)
    per_shard = -(-tasks // shards)
    written = total_bytes = 0
    for index in range(shards):
        first, last = index * per_shard, min(tasks, (index + 1) * per_shard)
        identities = [
            (task, rollout)
            for task in range(first, last)
            for rollout in range(ROLLOUTS_PER_TASK)
            if task * ROLLOUTS_PER_TASK + rollout < rows
        ]
        rng.shuffle(identities)
        with ShardWriter(run_dir, f"{index:05d}", run_id="merge-bench", config_identity=None) as writer:
            for task, rollout in identities:
                writer.append(_record(task, rollout))
        written += len(identities)
        total_bytes += writer.paths.successes.stat().st_size
    return {"rows": written, "shards": shards, "bytes": total_bytes}


def _peak_rss_mb() -> float:
    """This process's own peak RSS in MB (``VmHWM``, which starts afresh at ``exec``; else ru_maxrss)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / _KIB_PER_MB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _KIB_PER_MB


def _children_cpu_s() -> float:
    """User and system CPU of this process's children that have ended (and been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _child(run_dir: str) -> None:
    """Merge ``run_dir`` and print the child's figures as one JSON line."""
    from gym_ray.finalize.merge import merge_shards

    baseline = _peak_rss_mb()
    children0 = _children_cpu_s()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    merged = merge_shards(run_dir)
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    # the merge joins its sorting processes before it returns, so their CPU is counted by now
    children_cpu_s = _children_cpu_s() - children0
    print(
        json.dumps(
            {
                "successes": merged.successes,
                "failures": merged.failures,
                "duplicates_dropped": merged.duplicate_successes_dropped,
                "corrupt_lines": merged.corrupt_lines,
                "wall_s": wall_s,
                "cpu_s": cpu_s,
                "children_cpu_s": children_cpu_s,
                "baseline_rss_mb": baseline,
                "peak_rss_mb": _peak_rss_mb(),
            }
        )
    )


def _child_ahead(run_dir: str) -> None:
    """Reduce every shard but the last ahead of the merge and grow the output's prefix with them (as the
    coordinator does while a run goes on), then merge; print both wall times as one JSON line: the second is
    what is left once the last shard is done (that shard read and written, the prefix renamed)."""
    from gym_ray.finalize.merge import merge_shards
    from gym_ray.finalize.merge_ahead import grow_prefix, reduce_ahead
    from gym_ray.record.shard_files import list_shards

    shards = list_shards(run_dir)
    wall0 = time.perf_counter()
    stored = 0
    for shard in shards[:-1]:
        stored += reduce_ahead(run_dir, shard)
        grow_prefix(run_dir, shards)
    ahead_s = time.perf_counter() - wall0
    wall0 = time.perf_counter()
    merged = merge_shards(run_dir)
    tail_s = time.perf_counter() - wall0
    print(json.dumps({"stored": stored, "successes": merged.successes, "ahead_s": ahead_s, "tail_s": tail_s}))


def _run_child(mode: str, run_dir: Path) -> dict[str, Any]:
    from gym_ray.bench.child import run_module_child

    return run_module_child(
        "gym_ray.bench.merge_bench",
        [mode, str(run_dir)],
        what="merge bench child",
        timeout_s=_CHILD_TIMEOUT_S,
    )


def run_merge_bench(rows: int = 1_000_000, shards: int = 64) -> dict[str, Any]:
    """Generate ``shards`` shards of ``rows`` records, merge them in a child process, report the figures.

    Returns:
        ``{"rows", "shards", "input_mb", "avg_record_bytes", "generate_s", "merge_wall_s", "merge_cpu_s",
        "sorting_processes_cpu_s", "merge_cpu_us_per_line", "lines_per_s", "baseline_rss_mb",
        "peak_rss_mb"}`` (``merge_cpu_s``: the merging process's CPU; ``sorting_processes_cpu_s``: its
        pool's, start-up included; ``baseline_rss_mb``: the merging process's peak after its imports,
        before merging), and ``reduced_ahead_s`` / ``tail_after_ahead_s`` / ``tail_ratio``: the same shards
        but the last reduced one after the other and appended to the output's prefix (as the coordinator
        does while a run goes on), then merged: the merge's tail once the last shard is done, and its ratio
        to the whole merge; also printed.

    Raises:
        ValueError: ``rows`` < 1 or ``shards`` < 1.
        RuntimeError: The child failed, or the merged file does not hold every row exactly once.
    """
    if rows < 1 or shards < 1:
        raise ValueError(f"rows={rows!r}, shards={shards!r}: both must be >= 1")
    with tempfile.TemporaryDirectory(prefix="gym-ray-merge-bench-") as tmp:
        run_dir = Path(tmp)
        started = time.perf_counter()
        written = write_shards(run_dir, rows, shards)
        generate_s = time.perf_counter() - started
        child = _run_child("--child", run_dir)
        # the same shards again, reduced ahead first: the merge's tail once every shard is done
        ahead = _run_child("--child-ahead", run_dir)
    if child["successes"] != written["rows"] or child["duplicates_dropped"] or child["corrupt_lines"]:
        raise RuntimeError(f"merge bench: wrote {written['rows']} rows, merge reported {child}")
    result: dict[str, Any] = {
        "rows": written["rows"],
        "shards": shards,
        "input_mb": written["bytes"] / 1e6,
        "avg_record_bytes": written["bytes"] / written["rows"],
        "generate_s": generate_s,
        "merge_wall_s": child["wall_s"],
        "merge_cpu_s": child["cpu_s"],
        "sorting_processes_cpu_s": child["children_cpu_s"],
        "merge_cpu_us_per_line": (child["cpu_s"] + child["children_cpu_s"]) / written["rows"] * 1e6,
        "lines_per_s": written["rows"] / child["wall_s"] if child["wall_s"] > 0 else 0.0,
        "baseline_rss_mb": child["baseline_rss_mb"],
        "peak_rss_mb": child["peak_rss_mb"],
        "reduced_ahead_s": ahead["ahead_s"],
        "tail_after_ahead_s": ahead["tail_s"],
        "tail_ratio": ahead["tail_s"] / child["wall_s"] if child["wall_s"] > 0 else 0.0,
    }
    if ahead["stored"] != shards - 1 or ahead["successes"] != written["rows"]:
        raise RuntimeError(f"merge bench: {shards} shards reduced ahead, the child reported {ahead}")
    print(
        f"merge bench: rows={result['rows']} shards={shards} ({result['avg_record_bytes']:.0f} B/record) "
        f"{result['lines_per_s']:,.0f} lines/s, {result['merge_cpu_us_per_line']:.2f} us of CPU per line "
        f"(merging and sorting processes) peak_rss={result['peak_rss_mb']:.1f} MB "
        f"(baseline {result['baseline_rss_mb']:.1f} MB); with all shards but the last merged ahead "
        f"({result['reduced_ahead_s']:.2f} s while the run goes on) the merge's tail is "
        f"{result['tail_after_ahead_s']:.2f} s ({result['tail_ratio']:.2f} of the whole merge)",
        flush=True,
    )
    return result


def main(argv: list[str]) -> int:
    """``python -m gym_ray.bench.merge_bench [rows [shards]]``; ``--child DIR`` is the measured process."""
    if argv[:1] == ["--child"] and len(argv) == 2:
        _child(argv[1])
        return 0
    if argv[:1] == ["--child-ahead"] and len(argv) == 2:
        _child_ahead(argv[1])
        return 0
    numbers = [int(a) for a in argv[:2]]
    print(json.dumps(run_merge_bench(*numbers), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

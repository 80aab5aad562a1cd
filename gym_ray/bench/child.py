"""Run one benchmark measurement in a fresh spawned process and get its report back over a pipe.

A fresh process per measurement keeps peak-RSS figures honest: nothing allocated by an earlier
measurement (or by the parent) counts. The target receives the write end of a pipe as its first argument
and must send exactly one picklable dict on it; a dict with an ``"error"`` key (a formatted traceback)
is raised here as a RuntimeError.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: Upper bound on one child's run (1M rows at ~1000 rollouts/s is ~17 min).
CHILD_TIMEOUT_S = 3600.0


def run_in_child(
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    what: str,
    daemon: bool = True,
    timeout_s: float = CHILD_TIMEOUT_S,
) -> dict[str, Any]:
    """Start ``target(conn, *args)`` in a spawned process and return the dict it sends.

    Args:
        target: A module-level function (spawn pickles it by name).
        args: Its arguments after the pipe.
        what: How errors name the measurement (``"memory bench child for 1000 rows"``).
        daemon: False when the child starts processes of its own (a daemon may not).
        timeout_s: How long to wait for the report.

    Raises:
        RuntimeError: No report in time, the child died without one, or it reported an error.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args), daemon=daemon)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise RuntimeError(f"{what} gave no result within {timeout_s:.0f} s")
        report: dict[str, Any] = parent.recv()
    except EOFError as exc:
        raise RuntimeError(
            f"{what} exited without a result (exit code {proc.exitcode}); "
            "rerun with fewer rows to see its traceback"
        ) from exc
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()
    if "error" in report:
        raise RuntimeError(f"{what} failed:\n{report['error']}")
    return report


def peak_summary(label: str, runs: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """``{**fields, "runs", "peak_ratio", "max_peak_rss_mb"}`` for runs of several sizes; also printed.

    ``peak_ratio`` is the largest size's ``peak_rss_mb`` over the smallest size's (each run has ``rows``).
    """
    by_size = sorted(runs, key=lambda r: r["rows"])
    result: dict[str, Any] = {
        **fields,
        "runs": runs,
        "peak_ratio": by_size[-1]["peak_rss_mb"] / by_size[0]["peak_rss_mb"],
        "max_peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }
    print(
        f"{label}: peak ratio {result['peak_ratio']:.3f} "
        f"(rows {by_size[-1]['rows']} / {by_size[0]['rows']}), max peak {result['max_peak_rss_mb']:.1f} MB",
        flush=True,
    )
    return result


__all__ = ["CHILD_TIMEOUT_S", "peak_summary", "run_in_child"]


def run_module_child(
    module: str, args: Sequence[str], *, what: str, timeout_s: float = CHILD_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``python -m module *args`` (a fresh interpreter: its figures start from an empty process) and
    return the JSON object it prints on its last line of stdout.

    Raises:
        RuntimeError: The child exited with a failure (its stderr's end is in the message).
    """
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out

"""Shard and finalize functions for Ray runs that leave notes from the actors' processes: which
OpenTelemetry modules a process loaded, where the closing counts came from; and a shard function whose
worker dies once.

Kept apart from the tests that use them: an actor imports the module of a function it is given, and the
test modules import OpenTelemetry themselves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _first_time(marker: Path) -> bool:
    """Whether ``marker`` did not exist yet (it does now)."""
    if marker.exists():
        return False
    marker.touch()
    return True


def _note_modules(note_dir: str, role: str) -> None:
    """Write which ``opentelemetry`` and ``gym_ray`` modules this process has loaded, by package, to
    ``note_dir/<role>-<pid>.json``."""
    loaded = {
        top: sorted(name for name in sys.modules if name.split(".")[0] == top)
        for top in ("opentelemetry", "gym_ray")
    }
    Path(note_dir, f"{role}-{os.getpid()}.json").write_text(json.dumps(loaded))


def plan_noting_modules(note_dir: str, *args: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.distributed.driver.plan_from_config`, then a note from the driver's process."""
    from gym_ray.distributed.driver import plan_from_config

    yield from plan_from_config(*args, **kwargs)
    _note_modules(note_dir, "driver")


async def shard_noting_modules(note_dir: str, spec: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.collect.run_shard`, then a note from the worker's process."""
    from gym_ray.run.collect import run_shard

    report = await run_shard(spec, **kwargs)
    _note_modules(note_dir, "worker")
    return report


async def finalize_noting_modules(note_dir: str, plan: Any, reports: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.finalize.finalize_run`, then a note from the coordinator actor's process."""
    from gym_ray.run.finalize import finalize_run

    result = await finalize_run(plan, reports, **kwargs)
    _note_modules(note_dir, "coordinator")
    return result


async def finalize_noting_counts(note_dir: str, plan: Any, reports: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.finalize.finalize_run`, noting whether the coordinator was asked to count rows
    from the shard reports (``note_dir/counts_from_reports.json``)."""
    from gym_ray.run.finalize import finalize_run

    _write(Path(note_dir, "counts_from_reports.json"), json.dumps(kwargs.get("counts_from_reports")))
    return await finalize_run(plan, reports, **kwargs)


async def shard_dying_once(marker: str, shard: str, spec: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.collect.run_shard`; the first worker given ``shard`` exits its process instead
    (``marker`` is created then), so the driver re-queues the shard to a replacement."""
    from gym_ray.run.collect import run_shard

    if spec.shard == shard and _first_time(Path(marker)):
        os._exit(1)
    return await run_shard(spec, **kwargs)

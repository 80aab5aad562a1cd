"""Shard and finalize functions for Ray runs that note which OpenTelemetry modules their process loaded.

Kept apart from the tests that use them: an actor imports the module of a function it is given, and the
test modules import OpenTelemetry themselves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _note_opentelemetry(note_dir: str, role: str) -> None:
    """Write which ``opentelemetry`` modules this process has loaded to ``note_dir/<role>-<pid>.json``."""
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")
    Path(note_dir, f"{role}-{os.getpid()}.json").write_text(json.dumps(loaded))


async def shard_noting_modules(note_dir: str, spec: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.collect.run_shard`, then a note from the worker's process."""
    from gym_ray.run.collect import run_shard

    report = await run_shard(spec, **kwargs)
    _note_opentelemetry(note_dir, "worker")
    return report


async def finalize_noting_modules(note_dir: str, plan: Any, reports: Any, **kwargs: Any) -> Any:
    """:func:`gym_ray.run.finalize.finalize_run`, then a note from the host actor's process."""
    from gym_ray.run.finalize import finalize_run

    result = await finalize_run(plan, reports, **kwargs)
    _note_opentelemetry(note_dir, "host")
    return result

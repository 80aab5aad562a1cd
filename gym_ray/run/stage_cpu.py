"""CPU seconds per stage of a single-process run, for ``gym-ray bench pipeline`` (off by default).

When the environment variable :data:`STAGE_CPU_ENV` names a file, :func:`gym_ray.run.collect.acollect_local`
measures the CPU each stage of the run costs and, when the run returns, writes one JSON object to that
file (atomically)::

    {"stages": {"plan": s, "dispatch": s, "record": s, "merge": s, "aggregate": s},
     "process_cpu_at_start_s": s, "process_cpu_s": s, "peak_rss_mb": mb}

How each figure is taken (the stages of a local run follow each other, so a stage's process CPU is its
own; processes the stage started and joined, such as the merge's sort pool, are added):

- ``plan``, ``merge``, ``aggregate``: process CPU (``time.process_time`` plus joined children) from the
  stage's start to its end.
- ``dispatch``: process CPU while the shards run, *minus* ``record``.
- ``record``: thread CPU (``time.thread_time``) of the event loop thread around building each outcome's
  record and appending it through the shard's writer (fsync included), summed over rollouts. The two clock
  reads per rollout (about a microsecond) count here.
- ``process_cpu_at_start_s``: the process's CPU when the run began (interpreter start-up, imports, config);
  ``process_cpu_s``: its CPU (with joined children) when the file is written; ``peak_rss_mb``: this
  process's own peak resident memory (Linux ``VmHWM``, which starts afresh at ``exec``; a parent's
  ``ru_maxrss`` of its child would carry the parent's size at fork; elsewhere ``ru_maxrss``).

Without the variable nothing is measured: the hot path pays one ``is None`` test per rollout and the
file is never written. The file is a measurement tool, not a user-facing report.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import resource
import time
from collections.abc import Iterator, Mapping

from gym_ray.record.atomic import atomic_write_bytes

__all__ = [
    "STAGES",
    "STAGE_CPU_ENV",
    "StageCpu",
    "current_stage_cpu",
    "measuring",
    "peak_rss_mb",
    "stage_cpu_scope",
]

#: The environment variable naming the file a run writes its stage CPU to.
STAGE_CPU_ENV = "GYM_RAY_STAGE_CPU_FILE"
#: The stages, in the order a run goes through them.
STAGES = ("plan", "dispatch", "record", "merge", "aggregate")

_CURRENT: contextvars.ContextVar[StageCpu | None] = contextvars.ContextVar("gym_ray_stage_cpu", default=None)


def _process_cpu_s() -> float:
    """CPU seconds of this process and of every child it has waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def peak_rss_mb() -> float:
    """This process's own peak resident set size in MB (see the module docstring)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class StageCpu:
    """Accumulates CPU seconds per stage (see the module docstring for how each is taken)."""

    def __init__(self) -> None:
        """Start with every stage at zero and note the process CPU spent so far."""
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self.process_cpu_at_start_s = _process_cpu_s()

    @contextlib.contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        """Add the process CPU spent inside the ``with`` block to ``stage``.

        Raises:
            KeyError: ``stage`` is not one of :data:`STAGES`.
        """
        if stage not in self._seconds:
            raise KeyError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        started = _process_cpu_s()
        try:
            yield
        finally:
            self._seconds[stage] += _process_cpu_s() - started

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` of CPU to ``stage`` (a per-rollout measurement taken by the caller).

        Raises:
            KeyError: ``stage`` is not one of :data:`STAGES`.
        """
        self._seconds[stage] += seconds

    def stages(self) -> dict[str, float]:
        """CPU seconds per stage, ``dispatch`` net of ``record`` (which it encloses)."""
        out = dict(self._seconds)
        out["dispatch"] = max(0.0, out["dispatch"] - out["record"])
        return out

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the figures as one JSON object to ``path`` (atomically)."""
        report = {
            "stages": self.stages(),
            "process_cpu_at_start_s": self.process_cpu_at_start_s,
            "process_cpu_s": _process_cpu_s(),
            "peak_rss_mb": peak_rss_mb(),
        }
        atomic_write_bytes(path, json.dumps(report, indent=2).encode() + b"\n")


def current_stage_cpu() -> StageCpu | None:
    """The :class:`StageCpu` of the run this task belongs to, or None when nothing is measured."""
    return _CURRENT.get()


def measuring(stage: str) -> contextlib.AbstractContextManager[None]:
    """``current_stage_cpu().measure(stage)`` when the run is measured, else a no-op context manager."""
    stage_cpu = _CURRENT.get()
    return contextlib.nullcontext() if stage_cpu is None else stage_cpu.measure(stage)


@contextlib.contextmanager
def stage_cpu_scope(environ: Mapping[str, str] | None = None) -> Iterator[StageCpu | None]:
    """Measure the stages of the run inside the block when :data:`STAGE_CPU_ENV` is set.

    Yields the :class:`StageCpu` made current for the block (tasks and ``asyncio.to_thread`` calls started
    inside see it), or None when the variable is unset or empty. The file is written when the block ends
    without an exception.

    Args:
        environ: Where to read the variable (default ``os.environ``).
    """
    path = (os.environ if environ is None else environ).get(STAGE_CPU_ENV) or None
    if path is None:
        yield None
        return
    stage_cpu = StageCpu()
    token = _CURRENT.set(stage_cpu)
    try:
        yield stage_cpu
    finally:
        _CURRENT.reset(token)
    stage_cpu.write(path)

"""gym_ray on Ray: the worker actors and the run's host actor (driver and coordinator), and ``collect`` /
``acollect``.

Importing this package does not import Ray; the actors are plain classes made remote by
:func:`~gym_ray.distributed.api.run_actors` (every actor with ``num_cpus=0``: they are IO bound).
"""

from __future__ import annotations

from gym_ray.distributed.api import RunActors, acollect, collect, plan_from_config, run_actors
from gym_ray.distributed.coordinator import RunCoordinator, RunStatus, ShardTiming
from gym_ray.distributed.driver import DriverStatus, ShardDriver, ShardFailure
from gym_ray.distributed.host import RunHost
from gym_ray.distributed.live import ProgressSnapshot
from gym_ray.distributed.worker import RolloutWorker, WorkerProgress, WorkerTotals

__all__ = [
    "DriverStatus",
    "ProgressSnapshot",
    "RolloutWorker",
    "RunActors",
    "RunCoordinator",
    "RunHost",
    "RunStatus",
    "ShardDriver",
    "ShardFailure",
    "ShardTiming",
    "WorkerProgress",
    "WorkerTotals",
    "acollect",
    "collect",
    "plan_from_config",
    "run_actors",
]

"""gym_ray on Ray: the run's driver, coordinator and worker actors, and ``collect`` / ``acollect``.

Importing this package does not import Ray; the actors are plain classes made remote by
:func:`~gym_ray.distributed.api.run_actors` (every actor with ``num_cpus=0``: they are IO bound). Its
names are imported on first use (PEP 562), so an actor process that imports
``gym_ray.distributed.worker`` does not also import ``collect``'s planning and the other actors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gym_ray._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_ray.distributed.api import RunActors, acollect, collect, plan_from_config, run_actors
    from gym_ray.distributed.coordinator import RunCoordinator, RunStatus, ShardTiming
    from gym_ray.distributed.driver import DriverStatus, RunDriver, ShardDriver, ShardFailure
    from gym_ray.distributed.live import ProgressSnapshot
    from gym_ray.distributed.worker import RolloutWorker, WorkerProgress, WorkerTotals

_LAZY: dict[str, str] = {
    "DriverStatus": "gym_ray.distributed.driver",
    "ProgressSnapshot": "gym_ray.distributed.live",
    "RolloutWorker": "gym_ray.distributed.worker",
    "RunActors": "gym_ray.distributed.api",
    "RunCoordinator": "gym_ray.distributed.coordinator",
    "RunDriver": "gym_ray.distributed.driver",
    "RunStatus": "gym_ray.distributed.coordinator",
    "ShardDriver": "gym_ray.distributed.driver",
    "ShardFailure": "gym_ray.distributed.driver",
    "ShardTiming": "gym_ray.distributed.coordinator",
    "WorkerProgress": "gym_ray.distributed.worker",
    "WorkerTotals": "gym_ray.distributed.worker",
    "acollect": "gym_ray.distributed.api",
    "collect": "gym_ray.distributed.api",
    "plan_from_config": "gym_ray.distributed.api",
    "run_actors": "gym_ray.distributed.api",
}

__all__ = [
    "DriverStatus",
    "ProgressSnapshot",
    "RolloutWorker",
    "RunActors",
    "RunCoordinator",
    "RunDriver",
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


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

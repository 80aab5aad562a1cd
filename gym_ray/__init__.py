"""gym_ray: collect rollouts from NeMo Gym-style environment servers at cluster scale on Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gym_ray._lazy import lazy_exports
from gym_ray.errors import (
    ActorLostError,
    AggregationError,
    ConfigError,
    GymRayError,
    IncompleteRunError,
    InputError,
    InternalError,
    NoProgressError,
    RecordError,
    ResumeError,
    RoutingError,
    RunLockError,
    RunRejectedError,
    RunTerminated,
    ServerConnectionError,
    ServerError,
    ServerHTTPError,
    ServerOutageError,
    ServerResponseError,
    ShardIOError,
    ShardLockError,
    UsageError,
    ValidationError,
)

if TYPE_CHECKING:
    from gym_ray.config.settings import RunSettings, load_config
    from gym_ray.config.topology import Topology
    from gym_ray.dispatch.client import LoadSample, ServerClient
    from gym_ray.dispatch.engine import DispatchStats
    from gym_ray.dispatch.helper import RolloutCollectionHelper
    from gym_ray.dispatch.outcomes import RolloutFailureRecord
    from gym_ray.distributed.api import acollect, collect
    from gym_ray.plan.load import load_jsonl
    from gym_ray.plan.preprocess import preprocess_examples
    from gym_ray.plan.validation import resolve_task_sources, validate_rows
    from gym_ray.record.ledger import LedgerReport, check_run
    from gym_ray.run.collect import acollect_local
    from gym_ray.run.result import RunResult
    from gym_ray.streaming.api import stream
    from gym_ray.streaming.filters import drop_failed, drop_uniform_reward
    from gym_ray.streaming.groups import RolloutGroup
    from gym_ray.streaming.row_feed import RowFeed
    from gym_ray.streaming.stream import RolloutStream
    from gym_ray.streaming.sync import stream_sync

#: The rest of the public API, imported on first use (PEP 562): ``import gym_ray`` stays cheap for the
#: processes that need one part of it (a merge's sorting processes, Ray workers, the CLI's start).
_LAZY: dict[str, str] = {
    "DispatchStats": "gym_ray.dispatch.engine",
    "LedgerReport": "gym_ray.record.ledger",
    "LoadSample": "gym_ray.dispatch.client",
    "RolloutCollectionHelper": "gym_ray.dispatch.helper",
    "RolloutFailureRecord": "gym_ray.dispatch.outcomes",
    "RolloutGroup": "gym_ray.streaming.groups",
    "RolloutStream": "gym_ray.streaming.stream",
    "RowFeed": "gym_ray.streaming.row_feed",
    "RunResult": "gym_ray.run.result",
    "RunSettings": "gym_ray.config.settings",
    "ServerClient": "gym_ray.dispatch.client",
    "Topology": "gym_ray.config.topology",
    "acollect": "gym_ray.distributed.api",
    "acollect_local": "gym_ray.run.collect",
    "check_run": "gym_ray.record.ledger",
    "collect": "gym_ray.distributed.api",
    "drop_failed": "gym_ray.streaming.filters",
    "drop_uniform_reward": "gym_ray.streaming.filters",
    "load_config": "gym_ray.config.settings",
    "load_jsonl": "gym_ray.plan.load",
    "preprocess_examples": "gym_ray.plan.preprocess",
    "resolve_task_sources": "gym_ray.plan.validation",
    "stream": "gym_ray.streaming.api",
    "stream_sync": "gym_ray.streaming.sync",
    "validate_rows": "gym_ray.plan.validation",
}


__version__ = "0.1.0"

__all__ = [
    "ActorLostError",
    "AggregationError",
    "ConfigError",
    "DispatchStats",
    "GymRayError",
    "IncompleteRunError",
    "InputError",
    "InternalError",
    "LedgerReport",
    "LoadSample",
    "NoProgressError",
    "RecordError",
    "ResumeError",
    "RolloutCollectionHelper",
    "RolloutFailureRecord",
    "RolloutGroup",
    "RolloutStream",
    "RoutingError",
    "RowFeed",
    "RunLockError",
    "RunRejectedError",
    "RunResult",
    "RunSettings",
    "RunTerminated",
    "ServerClient",
    "ServerConnectionError",
    "ServerError",
    "ServerHTTPError",
    "ServerOutageError",
    "ServerResponseError",
    "ShardIOError",
    "ShardLockError",
    "Topology",
    "UsageError",
    "ValidationError",
    "__version__",
    "acollect",
    "acollect_local",
    "check_run",
    "collect",
    "drop_failed",
    "drop_uniform_reward",
    "load_config",
    "load_jsonl",
    "preprocess_examples",
    "resolve_task_sources",
    "stream",
    "stream_sync",
    "validate_rows",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

"""gym_ray: collect rollouts from NeMo Gym-style environment servers at cluster scale on Ray."""

from __future__ import annotations

from gym_ray.client import LoadSample, ServerClient
from gym_ray.collect import RunResult, acollect_local
from gym_ray.config import RunSettings, load_config
from gym_ray.dispatch import DispatchStats
from gym_ray.distributed.api import acollect, collect
from gym_ray.errors import (
    AggregationError,
    ConfigError,
    GymRayError,
    InputError,
    InternalError,
    NoProgressError,
    RecordError,
    ResumeError,
    RoutingError,
    RunRejectedError,
    ServerConnectionError,
    ServerError,
    ServerHTTPError,
    ServerResponseError,
    ShardIOError,
    ShardLockError,
    UsageError,
    ValidationError,
)
from gym_ray.helper import RolloutCollectionHelper
from gym_ray.ledger import LedgerReport, check_run
from gym_ray.outcomes import RolloutFailureRecord
from gym_ray.preprocess import load_jsonl, preprocess_examples
from gym_ray.stream import RolloutStream, RowFeed, stream
from gym_ray.stream_sync import stream_sync
from gym_ray.topology import Topology
from gym_ray.validation import resolve_task_sources, validate_rows

__version__ = "0.1.0"

__all__ = [
    "AggregationError",
    "ConfigError",
    "DispatchStats",
    "GymRayError",
    "InputError",
    "InternalError",
    "LedgerReport",
    "LoadSample",
    "NoProgressError",
    "RecordError",
    "ResumeError",
    "RolloutCollectionHelper",
    "RolloutFailureRecord",
    "RolloutStream",
    "RoutingError",
    "RowFeed",
    "RunRejectedError",
    "RunResult",
    "RunSettings",
    "ServerClient",
    "ServerConnectionError",
    "ServerError",
    "ServerHTTPError",
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
    "load_config",
    "load_jsonl",
    "preprocess_examples",
    "resolve_task_sources",
    "stream",
    "stream_sync",
    "validate_rows",
]

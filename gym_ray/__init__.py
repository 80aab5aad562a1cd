"""gym_ray: collect rollouts from NeMo Gym-style environment servers at cluster scale on Ray."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "AggregationError",
    "ConfigError",
    "GymRayError",
    "InputError",
    "InternalError",
    "NoProgressError",
    "RecordError",
    "ResumeError",
    "RoutingError",
    "RunRejectedError",
    "ServerConnectionError",
    "ServerError",
    "ServerHTTPError",
    "ServerResponseError",
    "ShardIOError",
    "ShardLockError",
    "UsageError",
    "ValidationError",
    "__version__",
]

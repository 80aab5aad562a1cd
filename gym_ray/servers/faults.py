"""Fault injection for the reference servers: error statuses, 429s, hangs, drops and bad bodies.

Faults come from two places, checked in this order:

1. the row field ``fault`` (one of ``ROW_FAULTS``), which forces that fault for that row on every
   attempt, or only on attempts ``< fault_until_attempt`` when the row sets that int;
2. the instance's ``faults:`` mapping (``FaultConfig``): rates in [0, 1] that sum to at most 1. One
   seeded draw per (task, rollout, attempt) picks at most one fault, so a test can compute which rows fail
   with ``FaultConfig.choose`` and a retry of a failed attempt draws again.

What each fault does to ``POST /run``:

=============  ===========================================================================
status         HTTP ``error_status`` (or the row's 500 / 503) with ``{"error": ...}``
429            HTTP 429 with ``Retry-After: retry_after_s`` (when set)
hang           never answers; the handler ends only when the client disconnects
disconnect     200 headers and part of the body, then the connection is dropped
drop           the connection is dropped before any byte of the reply
truncated      200 ``application/json`` whose body is cut mid-object (malformed JSON)
non_object     200 with a JSON list instead of an object
=============  ===========================================================================
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from aiohttp import web

from gym_ray.errors import ConfigError, InputError, InternalError
from gym_ray.servers.policy import RolloutKey, unit_draw

#: Values of the row field ``fault``.
ROW_FAULTS: Final = ("500", "503", "429", "hang", "disconnect", "drop", "truncated", "non_object")

#: ``faults:`` rate fields, in draw order, with the fault kind each one injects.
RATE_FIELDS: Final = (
    ("error_rate", "status"),
    ("status_429_rate", "429"),
    ("hang_rate", "hang"),
    ("disconnect_rate", "disconnect"),
    ("drop_rate", "drop"),
    ("malformed_json_rate", "truncated"),
    ("non_object_rate", "non_object"),
)
_KNOWN_FIELDS: Final = frozenset(
    {name for name, _ in RATE_FIELDS} | {"error_status", "retry_after_s", "seed", "aggregate_error_status"}
)


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` (see the module table) and, for ``status``, the HTTP status."""

    kind: str
    status: int | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True)
class FaultConfig:
    """An instance's ``faults:`` mapping. All rates default to 0 (no faults)."""

    error_status: int = 500
    error_rate: float = 0.0
    status_429_rate: float = 0.0
    retry_after_s: float | None = None
    hang_rate: float = 0.0
    disconnect_rate: float = 0.0
    drop_rate: float = 0.0
    malformed_json_rate: float = 0.0
    non_object_rate: float = 0.0
    seed: int = 0
    aggregate_error_status: int | None = None

    @classmethod
    def from_mapping(cls, raw: object, *, key_path: str) -> FaultConfig:
        """Validate a ``faults:`` mapping. ``key_path`` names it in errors (``<inst>...faults``).

        Raises:
            ConfigError: an unknown field, a rate outside [0, 1], rates summing above 1, or a bad status.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{key_path} = {raw!r} is not a mapping; write e.g. {{error_rate: 0.1}}", key=key_path
            )
        unknown = sorted(set(raw) - _KNOWN_FIELDS)
        if unknown:
            raise ConfigError(
                f"{key_path} has unknown field(s) {unknown}; known fields: {sorted(_KNOWN_FIELDS)}",
                key=key_path,
            )
        values: dict[str, Any] = {}
        for name, _ in RATE_FIELDS:
            if name in raw:
                values[name] = _number(raw[name], f"{key_path}.{name}", low=0.0, high=1.0)
        total = sum(values.values())
        if total > 1.0 + 1e-9:
            raise ConfigError(f"{key_path} rates sum to {total:g} > 1; lower them", key=key_path)
        for name in ("error_status", "aggregate_error_status"):
            if raw.get(name) is not None:
                status = raw[name]
                if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
                    raise ConfigError(
                        f"{key_path}.{name} = {status!r} is not an HTTP error status (400-599)",
                        key=f"{key_path}.{name}",
                    )
                values[name] = status
        if raw.get("retry_after_s") is not None:
            values["retry_after_s"] = _number(raw["retry_after_s"], f"{key_path}.retry_after_s", low=0.0)
        if "seed" in raw:
            seed = raw["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ConfigError(f"{key_path}.seed = {seed!r} is not an integer", key=f"{key_path}.seed")
            values["seed"] = seed
        return cls(**values)

    def choose(self, key: RolloutKey) -> Fault | None:
        """The configured fault for this rollout attempt, or None (deterministic)."""
        u = unit_draw("fault", self.seed, key.task, key.rollout, key.attempt)
        edge = 0.0
        for name, kind in RATE_FIELDS:
            edge += float(getattr(self, name))
            if u < edge:
                return self._fault(kind)
        return None

    def _fault(self, kind: str) -> Fault:
        if kind == "status":
            return Fault("status", status=self.error_status)
        if kind == "429":
            return Fault("429", status=429, retry_after_s=self.retry_after_s)
        return Fault(kind)


def row_fault(row: Mapping[str, Any], attempt: int, *, where: str) -> Fault | None:
    """The fault a row forces with its ``fault`` field (and ``fault_until_attempt``), or None.

    Raises:
        InputError: ``fault`` is not one of ``ROW_FAULTS`` (``where`` names the row in the message).
    """
    value = row.get("fault")
    if value is None:
        return None
    value = str(value)
    if value not in ROW_FAULTS:
        raise InputError(f"{where}.fault = {value!r} is not one of {list(ROW_FAULTS)}")
    until = row.get("fault_until_attempt")
    if isinstance(until, int) and not isinstance(until, bool) and attempt >= until:
        return None
    if value in ("500", "503"):
        return Fault("status", status=int(value))
    if value == "429":
        return Fault("429", status=429, retry_after_s=1.0)
    return Fault(value)


async def inject(request: web.Request, fault: Fault) -> web.StreamResponse:
    """Perform ``fault`` on ``request``; returns the (possibly broken) reply, or waits until cancelled."""
    if fault.kind == "status":
        status = fault.status or 500
        return web.json_response({"error": f"injected fault: HTTP {status}"}, status=status)
    if fault.kind == "429":
        headers = {} if fault.retry_after_s is None else {"Retry-After": f"{fault.retry_after_s:g}"}
        return web.json_response({"error": "injected fault: too many requests"}, status=429, headers=headers)
    if fault.kind == "hang":
        await _wait_forever()
    if fault.kind in ("disconnect", "drop"):
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        if fault.kind == "disconnect":
            resp.content_length = 4096
            await resp.prepare(request)
            await resp.write(b'{"reward": 1.0, "response": {"id": "resp_')
        if request.transport is not None:
            request.transport.close()
        return resp
    if fault.kind == "truncated":
        text = json.dumps({"reward": 1.0, "response": {"output": []}})
        return web.Response(status=200, text=text[: len(text) // 2], content_type="application/json")
    return web.json_response([{"reward": 1.0}], status=200)


async def _wait_forever() -> NoReturn:
    await asyncio.Event().wait()  # ends by cancellation when the client goes away
    raise InternalError("an event nobody sets was set")


def _number(value: object, key: str, *, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} = {value!r} is not a number", key=key)
    v = float(value)
    if v < low or (high is not None and v > high):
        bound = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ConfigError(f"{key} = {value!r} is outside {bound}", key=key)
    return v

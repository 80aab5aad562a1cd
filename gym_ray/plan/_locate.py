"""The first line of an input file that planning refuses, as a one-line error (failing runs only).

Planning validates rows in bulk: its errors list every offending row by its position in the
preprocessed stream (``row 17 (task 3, rollout 1)``, counted from 0, repeats included), on several
lines. A user reading a file counts lines from 1, as the JSON errors do (``rows.jsonl, line 6: ...``).
Every line of an input file is one row (blank lines are refused while reading), so input row ``i`` is
line ``i + 1``. :func:`located_error` runs the same preprocessing and validation again, one input row at
a time, and gives the first offending row's problem on one line naming the file and that line, with the
number of other lines that have a problem and what to do.

Cost: one more pass over the input, only after planning has refused it; memory as the general pass's
(the task numbering in memory, problems bounded by ``MAX_LISTED_ROWS``).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable

from gym_ray import keys
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.errors import InputError, RoutingError, UsageError, ValidationError
from gym_ray.plan._validate_pass import preprocess_knobs
from gym_ray.plan.load import _load_jsonl_via, until_stopped
from gym_ray.plan.preprocess import _Preprocessor
from gym_ray.plan.rows import Problems
from gym_ray.plan.validation import _Validator

__all__ = ["located_error"]

#: Agents named in the error of a row whose agent the config lacks (the rest are counted).
_LISTED_AGENTS = 8


def located_error(
    settings: RunSettings, topology: Topology, stop: threading.Event | None = None
) -> UsageError | None:
    """The refused input file's first offending line as one error, or None when there is no file to
    number (rows passed as a list, ``interleave_repeats``) or no row-level problem is found here (the
    caller then raises the general error).

    Raises:
        InputError: A line that is not JSON or not a row (the reader's own one-line error).
        Stopped: ``stop`` was set.
    """
    path = settings.input_jsonl_fpath
    if path is None or settings.interleave_repeats:
        return None
    name = os.fspath(path)
    state = _Preprocessor(**preprocess_knobs(settings), topology=topology, from_json=True)
    validator = _Validator(topology)
    groups: list[tuple[Problems, Callable[[int, str, str], UsageError]]] = [
        (state.bad_rows, lambda line, problem, more: _bad_row(name, line, problem, more)),
        (state.unresolved, lambda line, problem, more: _unresolved(name, line, problem, more)),
        (validator.routing, lambda line, problem, more: _unroutable(name, line, problem, more)),
        (validator.names, lambda line, problem, more: _unknown_agent(name, line, problem, more, topology)),
        (validator.pairing, lambda line, problem, more: _pairing(name, line, problem, more)),
        (validator.fronts, lambda line, problem, more: _no_front(name, line, problem, more)),
    ]
    rows = _load_jsonl_via(name, strict_json=settings.strict_json)
    limited = rows if not settings.limit else itertools.islice(rows, settings.limit)
    first: tuple[int, Problems, Callable[[int, str, str], UsageError]] | None = None
    offending = 0
    position = 0
    for index, row in enumerate(until_stopped(limited, stop)):
        before = sum(group.count() for group, _ in groups)
        for out in state.expand(index, row):
            validator.check(position, out)
            position += 1
        if sum(group.count() for group, _ in groups) == before:
            continue
        offending += 1
        if first is None:
            first = next((index + 1, group, make) for group, make in groups if group.count())
    if first is None:
        return None
    line, group, make = first
    more = offending - 1
    return make(
        line, group.first(), f" ({more} more line{'s' if more != 1 else ''} with a problem)" if more else ""
    )


def _bad_row(name: str, line: int, problem: str, more: str) -> UsageError:
    return InputError(f"{name}, line {line}: {problem}{more}", path=name, line=line)


def _unresolved(name: str, line: int, problem: str, more: str) -> UsageError:
    return ValidationError(
        f"{name}, line {line}: task_source {problem}{more}; agent_map ({{task_source: agent}}) picks the "
        "agent for a task_source",
        problems=[problem],
    )


def _unroutable(name: str, line: int, problem: str, more: str) -> UsageError:
    return RoutingError(
        f"{name}, line {line}: the row cannot be routed: {problem}{more}; fix the stamps or "
        "environment_server_routes in the config, or re-preprocess the rows",
        key=keys.ENVIRONMENT_SERVER_ROUTES,
    )


def _unknown_agent(name: str, line: int, problem: str, more: str, topology: Topology) -> UsageError:
    agents = sorted(topology.agents())
    listed = ", ".join(agents[:_LISTED_AGENTS]) + (
        f" and {len(agents) - _LISTED_AGENTS} more" if len(agents) > _LISTED_AGENTS else ""
    )
    return ValidationError(
        f"{name}, line {line}: unknown agent: {problem}{more}; the config's agents: {listed or 'none'}; "
        "include the agent's config in the run or re-route the rows with agent_map",
        problems=[f"unknown agent: {problem}"],
    )


def _pairing(name: str, line: int, problem: str, more: str) -> UsageError:
    return ValidationError(
        f"{name}, line {line}: unsupported pairing: {problem}{more}; route the rows to an accepted agent or "
        "set allow_unsupported_pairing=true",
        problems=[f"unsupported pairing: {problem}"],
    )


def _no_front(name: str, line: int, problem: str, more: str) -> UsageError:
    return RoutingError(
        f"{name}, line {line}: the row's agent has no unique environment server: {problem}{more}; set "
        "environment_routing_mode=legacy with environment_server_name, or route the rows by taskset",
        key=keys.ENVIRONMENT_ROUTING_MODE,
    )

"""Row helpers shared by :mod:`gym_ray.plan.preprocess` and :mod:`gym_ray.plan.validation`.

Reading a row's identity (agent, taskset, position text), collecting offending rows per problem with a
bounded listing, and resolving a ``task_source`` to an agent (PROTOCOL.md section 4). Nothing here mutates
a row; nothing here is thread-safe (each pass builds its own :class:`Problems` and :class:`SourceResolver`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gym_ray import keys
from gym_ray.config.topology import Topology, did_you_mean
from gym_ray.errors import ValidationError

__all__ = [
    "MAX_LISTED_ROWS",
    "Problems",
    "Row",
    "SourceResolver",
    "agent_of",
    "bounded_listing",
    "is_materialized_row",
    "shape_problem",
    "str_key",
    "taskset_of",
    "unresolved_error",
    "where",
]

#: Rows named per problem in an error message; the rest are counted.
MAX_LISTED_ROWS = 20

Row = dict[str, Any]


def is_materialized_row(row: Mapping[str, Any]) -> bool:
    """True for a materialized task row: ``task_id`` is an object and ``task_input`` is present."""
    task_id = row.get(keys.TASK_ID)
    # dict first: a plain dict skips the ABC check (these run several times per row while planning)
    return task_id is not None and isinstance(task_id, dict | Mapping) and keys.TASK_INPUT in row


def agent_of(row: Mapping[str, Any]) -> str | None:
    """``agent_ref.name`` when it is a non-empty string, else None."""
    ref = row.get(keys.AGENT_REF)
    name = ref.get("name") if isinstance(ref, dict | Mapping) else None
    return name if isinstance(name, str) and name else None


def str_key(row: Mapping[str, Any], key: str) -> str | None:
    """``row[key]`` when it is a non-empty string, else None."""
    value = row.get(key)
    return value if isinstance(value, str) and value else None


def taskset_of(row: Mapping[str, Any]) -> str | None:
    """``task_id.taskset`` when it is a non-empty string, else None."""
    task_id = row.get(keys.TASK_ID)
    return str_key(task_id, keys.TASKSET) if isinstance(task_id, Mapping) else None


def where(pos: int, row: Mapping[str, Any]) -> str:
    """``row 17 (task 3, rollout 1)``: a row by 0-based position and by identity."""
    parts: list[str] = []
    if is_materialized_row(row):
        parts.append(f"task_id {taskset_of(row)}/{row[keys.TASK_ID].get(keys.TASK_ID)}")
    for key, label in ((keys.TASK_INDEX, "task"), (keys.ROLLOUT_INDEX, "rollout")):
        if key in row:
            parts.append(f"{label} {row[key]}")
    return f"row {pos}" + (f" ({', '.join(parts)})" if parts else "")


def shape_problem(row: Any) -> str | None:
    """What makes ``row`` unusable as a row, or None."""
    if not isinstance(row, dict | Mapping):
        return f"is a JSON {type(row).__name__}, not an object"
    if is_materialized_row(row):
        task_id = row[keys.TASK_ID]
        if taskset_of(row) is None:
            return "is a materialized task row whose task_id.taskset is missing or not a non-empty string"
        if not isinstance(task_id.get(keys.TASK_ID), str):
            return "is a materialized task row whose task_id.task_id is missing or not a string"
        if not isinstance(row[keys.TASK_INPUT], Mapping):
            return "is a materialized task row whose task_input is not an object"
        return None
    if keys.RESPONSES_CREATE_PARAMS not in row:
        return (
            "has no 'responses_create_params' (a flat row needs it; a materialized task row needs "
            "'task_id' and 'task_input' instead)"
        )
    if not isinstance(row[keys.RESPONSES_CREATE_PARAMS], dict | Mapping):
        return "has a 'responses_create_params' that is not an object"
    return None


def bounded_listing(values: Sequence[Any]) -> str:
    """``['a', 'b' and 3 more]``: at most ``MAX_LISTED_ROWS`` values, the rest counted."""
    shown = ", ".join(repr(v) for v in values[:MAX_LISTED_ROWS])
    more = len(values) - MAX_LISTED_ROWS
    return f"[{shown}{f' and {more} more' if more > 0 else ''}]"


class Problems:
    """Offending rows grouped by problem text, at most ``MAX_LISTED_ROWS`` named per problem."""

    def __init__(self) -> None:
        self._rows: dict[str, list[str]] = {}
        self._counts: dict[str, int] = {}

    def add(self, problem: str, pos: int | None = None, row: Mapping[str, Any] | None = None) -> None:
        """Count row ``pos`` under ``problem``; its description (with ``row``'s identity) is built only
        while fewer than ``MAX_LISTED_ROWS`` are named."""
        listed = self._rows.setdefault(problem, [])
        self._counts[problem] = self._counts.get(problem, 0) + 1
        if pos is not None and len(listed) < MAX_LISTED_ROWS:
            listed.append(where(pos, row) if row is not None else f"row {pos}")

    def __bool__(self) -> bool:
        return bool(self._rows)

    def count(self) -> int:
        """Rows counted under every problem (each once per problem it has)."""
        return sum(self._counts.values())

    def first(self) -> str:
        """The text of the first problem found (without the rows it names)."""
        return next(iter(self._rows))

    def lines(self) -> list[str]:
        """One line per problem: its text and the rows it names (``and N more`` past the limit)."""
        out = []
        for problem, listed in self._rows.items():
            more = self._counts[problem] - len(listed)
            rows = ", ".join(listed) + (f" and {more} more" if more and listed else "")
            out.append(f"{problem} [{rows}]" if rows else problem)
        return out

    def message(self, head: str, tail: str) -> str:
        """``head``, the problem lines as a bullet list, then ``tail``."""
        return head + "\n" + "\n".join(f"  - {line}" for line in self.lines()) + "\n" + tail


class SourceResolver:
    """Resolves a ``task_source`` to an agent once per distinct value (PROTOCOL.md section 4)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.cache: dict[str, tuple[str | None, str]] = {}

    def resolve(self, source: str) -> tuple[str | None, str]:
        """``(agent, "")`` or ``(None, problem)``."""
        if source not in self.cache:
            self.cache[source] = self._resolve(source)
        return self.cache[source]

    def _resolve(self, source: str) -> tuple[str | None, str]:
        topo = self.topology
        if source not in topo.instances:
            if source in topo.raw:
                return None, "not a server instance (it is a plain config key)"
            return None, f"not in the running config{did_you_mean(source, list(topo.instances))}"
        pins = list(dict.fromkeys(e.agent for e in topo.dataset_entries_of(source) if e.agent))
        if len(pins) > 1:
            return None, (
                f"its datasets pin conflicting agents ({sorted(pins)}), which task_source alone cannot tell "
                f"apart; pass agent_map={{'{source}': <agent>}} to pick one"
            )
        pin = pins[0] if pins else None
        if topo.is_agent(source):
            if pin is not None and pin != source:
                return None, (
                    f"a dataset declared by agent '{source}' pins agent '{pin}', but its rows are dispatched "
                    f"to the declaring agent; drop the pin or declare the dataset on '{pin}'"
                )
            return source, ""
        if source not in topo.resources_servers():
            kind = topo.instances[source].server_type
            return (
                None,
                f"instance is not an agent or resources server (it is {kind}); datasets cannot route there",
            )
        candidates = list(topo.agents_of_resources_server(source))
        if pin is not None:
            if pin in candidates:
                return pin, ""
            return None, (
                f"its datasets pin agent '{pin}', but no agent of that name references resources server "
                f"'{source}'; agents referencing it: {', '.join(candidates) or 'none'}"
            )
        if len(candidates) == 1:
            return candidates[0], ""
        if not candidates:
            return None, (
                f"no agent in the running config references resources server '{source}'; include an agent "
                "bound to it, or route the rows with agent_map"
            )
        return None, (
            f"{len(candidates)} agents reference this resources server ({sorted(candidates)}); pin one with "
            f"an 'agent:' key on the dataset, or pass agent_map={{'{source}': <agent>}}"
        )


def unresolved_error(problems: Problems) -> ValidationError:
    """The error for task_sources that resolve to no agent, listing ``problems``."""
    return ValidationError(
        problems.message(
            "Cannot resolve task_source to an agent:",
            "agent_map ({task_source: agent}) picks the agent for a task_source.",
        ),
        problems=problems.lines(),
    )

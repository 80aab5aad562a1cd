"""Checking rows against the running config (PROTOCOL.md section 4, Validation).

``resolve_task_sources`` and ``stamp_environment_agent_refs`` give rows their agent; ``validate_rows``
checks rows against the running config before any dispatch and reports every offending row at once.

Memory promise: ``validate_rows`` streams its input; its error reports list at most ``MAX_LISTED_ROWS``
rows per problem and count the rest, so they stay bounded. Rows are never mutated. Nothing here is
thread-safe; use one call per thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gym_ray import keys
from gym_ray.config.topology import Topology, did_you_mean
from gym_ray.errors import RoutingError, ValidationError
from gym_ray.plan.rows import (
    MAX_LISTED_ROWS,
    Problems,
    Row,
    SourceResolver,
    agent_of,
    is_materialized_row,
    str_key,
    taskset_of,
    unresolved_error,
)

__all__ = [
    "MAX_LISTED_ROWS",
    "resolve_task_sources",
    "stamp_environment_agent_refs",
    "validate_rows",
]


def resolve_task_sources(rows: Iterable[Mapping[str, Any]], topology: Topology) -> list[Row]:
    """Give every row that carries only a ``task_source`` the agent that task_source resolves to.

    An agent instance resolves to itself; a resources server to the single agent that references it, or
    to its datasets' ``agent:`` pin. Rows that already name an agent, materialized rows and rows stamped
    with an environment server (see :func:`stamp_environment_agent_refs`) are returned as they are.

    Args:
        rows: The rows (never mutated).
        topology: The running config.

    Returns:
        A new list: resolved rows are copies with ``agent_ref: {"name": agent}``, the others the same
        objects.

    Raises:
        ValidationError: One or more task_sources do not resolve (unknown name with a "did you mean",
            not a server instance, not an agent or resources server, no agent, several agents without a
            pin, conflicting pins); all are reported together with the rows they affect, in ``problems``.
    """
    resolver, problems, out = SourceResolver(topology), Problems(), []
    for pos, row in enumerate(rows):
        source = str_key(row, keys.TASK_SOURCE)
        if (
            source is None
            or agent_of(row) is not None
            or is_materialized_row(row)
            or str_key(row, keys.ENVIRONMENT_SERVER) is not None
        ):
            out.append(row if isinstance(row, dict) else dict(row))
            continue
        agent, problem = resolver.resolve(source)
        if agent is None:
            problems.add(f"'{source}': {problem}", pos, row)
            continue
        out.append({**row, keys.AGENT_REF: {"name": agent}})
    if problems:
        raise unresolved_error(problems)
    return out


def stamp_environment_agent_refs(rows: Iterable[Mapping[str, Any]], topology: Topology) -> list[Row]:
    """Stamp rows routed to an environment server with that server's attributed agent.

    A flat row with an ``_ng_environment_server`` stamp and no agent gets ``agent_ref: {"name": <the
    server's attributed agent>}``, so its results and metrics keep the agent it ran on. Rows that name an
    agent, materialized rows, unstamped rows and rows whose server has no attributed agent (or is not in
    the config; :func:`validate_rows` reports that) are returned as they are.

    Returns:
        A new list: stamped rows are copies, the others the same objects.
    """
    envs, out = set(topology.environment_servers()), []
    for row in rows:
        env = str_key(row, keys.ENVIRONMENT_SERVER)
        agent = topology.attributed_agent(env) if env in envs and env is not None else None
        if agent is None or agent_of(row) is not None or is_materialized_row(row):
            out.append(row if isinstance(row, dict) else dict(row))
        else:
            out.append({**row, keys.AGENT_REF: {"name": agent}})
    return out


# --- validation ---------------------------------------------------------------------------------


class _Validator:
    """One pass of :func:`validate_rows`; per-agent and per-server facts are computed once."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.envs = set(topology.environment_servers())
        self.routing, self.names, self.pairing, self.fronts = (
            Problems(),
            Problems(),
            Problems(),
            Problems(),
        )
        self._fronted: dict[str, frozenset[str]] = {}
        self._unknown_env: dict[str, str] = {}
        self._front_problem: dict[str, str | None] = {}
        self._name_problem: dict[str, str | None] = {}
        self._pairing: dict[tuple[str, str | None, str | None, str | None], list[str]] = {}
        self._taskset_entries: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
        self._clean: dict[tuple[str, str | None], bool] = {}
        for entry in topology.all_dataset_entries():
            if entry.taskset and entry.allowed_agents:
                label = f"dataset entry '{entry.name}' declared by '{entry.declared_by}'"
                self._taskset_entries.setdefault(entry.taskset, []).append((label, entry.allowed_agents))

    def name_problem(self, agent: str) -> str | None:
        if agent not in self._name_problem:
            topo, problem = self.topology, None
            if not topo.is_agent(agent):
                if agent in topo.instances:
                    kind = topo.instances[agent].server_type
                    problem = f"'{agent}' exists but is not an agent (it is a {kind} instance)"
                else:
                    problem = (
                        f"'{agent}' is not in the running config{did_you_mean(agent, list(topo.agents()))}"
                    )
            self._name_problem[agent] = problem
        return self._name_problem[agent]

    def front_problem(self, agent: str) -> str | None:
        if agent not in self._front_problem:
            try:
                self.topology.front_of(agent)
                self._front_problem[agent] = None
            except RoutingError as exc:
                self._front_problem[agent] = str(exc)
        return self._front_problem[agent]

    def pairing_problems(
        self, agent: str, source: str | None, env: str | None, taskset: str | None
    ) -> list[str]:
        """Verifiers whose ``allowed_agents`` reject ``agent`` for this kind of row."""
        cache_key = (agent, source, env, taskset)
        if cache_key in self._pairing:
            return self._pairing[cache_key]
        topo = self.topology
        agent_type = topo.agent_type(agent)
        # (verifier, description); a verifier met through two relations is checked once.
        verifiers: dict[str, str] = {}
        if source is not None and source in topo.instances:
            verifiers.setdefault(source, f"their task_source '{source}'")
        bound = topo.resources_server_of(agent)
        if bound is not None:
            verifiers.setdefault(bound, f"the resources server '{bound}' the agent runs against")
        env_bound = topo.resources_server_of(env) if env is not None else None
        if env_bound is not None:
            verifiers.setdefault(
                env_bound, f"the resources server '{env_bound}' of environment server '{env}'"
            )
        checks = [(label, topo.allowed_agents_of(name)) for name, label in verifiers.items()]
        if taskset is not None:
            checks.extend(self._taskset_entries.get(taskset, []))
        else:
            for entry in topo.dataset_entries_of(agent):
                if entry.allowed_agents:
                    label = f"dataset entry '{entry.name}' declared by '{entry.declared_by}'"
                    checks.append((label, entry.allowed_agents))
        found = [
            f"rows run agent '{agent}' (type '{agent_type}'), but {label} accepts only: {', '.join(allowed)}"
            for label, allowed in checks
            if allowed is not None and agent_type not in allowed
        ]
        self._pairing[cache_key] = found
        return found

    def unknown_env(self, env: str) -> str:
        if env not in self._unknown_env:
            self._unknown_env[env] = (
                f"environment server '{env}' is not in the running config"
                f"{did_you_mean(env, sorted(self.envs))}; environment servers: "
                f"{', '.join(sorted(self.envs)) or 'none'}"
            )
        return self._unknown_env[env]

    def fronted(self, env: str) -> frozenset[str]:
        if env not in self._fronted:
            self._fronted[env] = frozenset(self.topology.fronted_agents(env))
        return self._fronted[env]

    def clean(self, agent: str, source: str | None) -> bool:
        """True when :meth:`check` finds nothing in a flat row of ``agent`` and ``source`` without an
        environment stamp (every check it runs on such a row depends on these two alone)."""
        found = self._clean.get((agent, source))
        if found is None:
            found = (
                self.name_problem(agent) is None
                and (
                    self.topology.allow_unsupported_pairing
                    or not self.pairing_problems(agent, source, None, None)
                )
                and self.front_problem(agent) is None
            )
            self._clean[agent, source] = found
        return found

    def flat_row_clean(self, agent: str, source: Any) -> bool:
        """:meth:`clean` for a flat row's ``task_source`` as read (None, a string, or anything else: not
        known clean, so :meth:`check` looks at the row)."""
        return (source is None or type(source) is str) and self.clean(agent, source or None)

    def found(self) -> bool:
        """True when :meth:`check` has found a problem in some row."""
        return bool(self.routing or self.names or self.pairing or self.fronts)

    def check(self, pos: int, row: Mapping[str, Any]) -> None:
        if type(row) is dict and keys.TASK_ID not in row and keys.ENVIRONMENT_SERVER not in row:
            # the common row: a plain dict naming its agent, not materialized, not stamped
            ref = row.get(keys.AGENT_REF)
            agent = ref.get("name") if type(ref) is dict else None
            if type(agent) is str and agent and self.flat_row_clean(agent, row.get(keys.TASK_SOURCE)):
                return
        topo = self.topology
        if not isinstance(row, dict | Mapping):
            self.names.add(f"the row is a {type(row).__name__}, not an object", pos)
            return
        materialized, agent = is_materialized_row(row), agent_of(row)
        stamp = row.get(keys.ENVIRONMENT_SERVER)
        env = None if stamp is None else str(stamp)
        taskset = taskset_of(row) if materialized else None
        if env is None and taskset is not None:
            env = topo.routes.get(taskset)
            if env is None:
                self.routing.add(
                    f"taskset '{taskset}' has no environment_server_routes entry"
                    f"{did_you_mean(taskset, list(topo.routes))}",
                    pos,
                    row,
                )
                return
        if env is not None:
            if env not in self.envs:
                self.routing.add(self.unknown_env(env), pos, row)
                return
            fronted = self.fronted(env)
            if agent is not None and fronted and agent not in fronted:
                self.routing.add(
                    f"agent '{agent}' is not fronted by its environment server '{env}', which fronts: "
                    f"{', '.join(sorted(fronted))}",
                    pos,
                    row,
                )
                return
            agent = agent or topo.attributed_agent(env)
        elif agent is None:
            self.names.add(
                "the row has no agent_ref and no environment server stamp; resolve its task_source or "
                "preprocess it with agent_map",
                pos,
                row,
            )
            return
        if agent is None:
            return
        problem = self.name_problem(agent)
        if problem is not None:
            self.names.add(problem, pos, row)
            return
        if not topo.allow_unsupported_pairing:
            for found in self.pairing_problems(agent, str_key(row, keys.TASK_SOURCE), env, taskset):
                self.pairing.add(found, pos, row)
        if env is None:
            front = self.front_problem(agent)
            if front is not None:
                self.fronts.add(front, pos, row)


def validate_rows(rows: Iterable[Mapping[str, Any]], topology: Topology) -> None:
    """Check rows against the running config before any dispatch (PROTOCOL.md section 4, Validation).

    One pass over ``rows`` (an iterable is fine), with the per-agent and per-server facts computed once.
    Each error lists every offending row, by 0-based position and identity (``row 17 (task 3, rollout
    1)``; at most ``MAX_LISTED_ROWS`` per problem, the rest counted), grouped by problem.

    Raises:
        RoutingError: First, when rows are stamped for an environment server the config lacks, name an
            agent their stamped server does not front, or are materialized rows of a taskset without a
            route.
        ValidationError: Next, when rows name an agent the config lacks (with "did you mean", or "exists
            but is not an agent"), carry no agent at all, or run an agent whose type is not in the
            ``allowed_agents`` of their task_source, of the resources server the agent (or their
            environment server) binds, or of the dataset entry that declared them (a materialized row
            meets the entries of its taskset; a flat row every entry its agent declares). The config's
            ``allow_unsupported_pairing`` turns the ``allowed_agents`` check off. ``problems`` lists all.
        RoutingError: Last, when rows dispatched by agent name an agent without a unique front.
    """
    validator = _Validator(topology)
    for pos, row in enumerate(rows):
        validator.check(pos, row)
    if validator.routing:
        raise RoutingError(
            validator.routing.message(
                "Rows cannot be routed to their environment server:",
                "Fix the stamps or environment_server_routes in the config, or re-preprocess the rows.",
            ),
            key=keys.ENVIRONMENT_SERVER_ROUTES,
        )
    problems = Problems()
    for group, head in ((validator.names, "unknown agent"), (validator.pairing, "unsupported pairing")):
        for line in group.lines():
            problems.add(f"{head}: {line}")
    if problems:
        raise ValidationError(
            problems.message(
                "Rows disagree with the running config:",
                "Include the agents' configs in the run or re-route the rows with agent_map; for a pairing "
                "the verifier does not accept, route the rows to an accepted agent or set "
                "allow_unsupported_pairing=true.",
            ),
            problems=problems.lines(),
        )
    if validator.fronts:
        raise RoutingError(
            validator.fronts.message(
                "Rows cannot be routed: their agent has no unique environment server:",
                "Set environment_routing_mode=legacy with environment_server_name, or route the rows by "
                "taskset.",
            ),
            key=keys.ENVIRONMENT_ROUTING_MODE,
        )

"""The merged global config as a typed, immutable model (PROTOCOL.md section 1).

``Topology.from_config(cfg)`` reads the plain config dict that a deployment publishes on its head server
(or that :func:`gym_ray.config.settings.load_config` built) and answers every routing question the
collector asks:
which instances exist, which agents an environment server fronts, which environment server a row goes to,
which resources server verifies an agent, which datasets an instance declares.

Every top-level key whose value is a mapping holding a server-type block (``responses_api_models``,
``resources_servers``, ``responses_api_agents``, ``environment_servers``) is a server instance; every
other top-level key is a setting the topology ignores, except the routing keys and ``head_server``.
A malformed config is refused in ``from_config`` with a :class:`~gym_ray.errors.ConfigError` whose
``key`` is the dotted path of the offending value.

Concurrency: a ``Topology`` never changes after ``from_config`` returns (frozen dataclasses, read-only
mappings, tuples; ``raw`` hands out a fresh deep copy), so one instance may be shared by any number of
threads and tasks. It pickles by rebuilding from its raw config, so it crosses Ray actor boundaries.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gym_ray import keys
from gym_ray.config._parse import (
    DATASET_DECLARERS,
    LABELS,
    NAME,
    DatasetEntry,
    ServerInstance,
    ServerRef,
    article,
    bound_resources_server,
    did_you_mean,
    fronts_of_env,
    listing,
    parse_agent_types,
    parse_datasets,
    parse_head_url,
    parse_instance,
    parse_references,
    parse_routing,
    thaw,
)
from gym_ray.errors import ConfigError, RoutingError

# ServerRef, DatasetEntry, ServerInstance and did_you_mean live in gym_ray.config._parse (the
# parser builds them); they are part of this module's API.
__all__ = [
    "DatasetEntry",
    "ServerInstance",
    "ServerRef",
    "Topology",
    "did_you_mean",
]


def _describe_row(row: Mapping[str, Any]) -> str:
    ids = [f"{k}={row[k]!r}" for k in (keys.TASK_INDEX, keys.ROLLOUT_INDEX) if k in row]
    return f"row ({', '.join(ids)})" if ids else "row"


@dataclass(frozen=True, eq=False)
class Topology:
    """The global config as a model. Build it with :meth:`from_config`.

    Attributes:
        instances: every server instance, in config order.
        head_url: ``"http://host:port"`` of ``head_server``, or None when the config has none.
        routes: ``environment_server_routes`` (taskset -> environment server).
        routing_mode: ``agent`` (default), ``legacy`` or ``taskset``.
        environment_server_name: the server every flat row goes to in ``legacy`` mode, or None.
        agent_map: the top-level ``agent_map`` (key -> agent instance).
        allow_unsupported_pairing: True turns off the ``allowed_agents`` pairing check.

    Example:
        >>> topo = Topology.from_config(cfg)
        >>> topo.environment_server_for_row({"agent_ref": {"name": "math_simple_agent"}, ...})
        'math_environment_server'
    """

    instances: Mapping[str, ServerInstance]
    head_url: str | None
    routes: Mapping[str, str]
    routing_mode: str
    environment_server_name: str | None
    agent_map: Mapping[str, str]
    allow_unsupported_pairing: bool
    _raw: dict[str, Any] = field(repr=False)
    _bound: Mapping[str, str | None] = field(repr=False)
    _fronted: Mapping[str, tuple[str, ...]] = field(repr=False)
    _attributed: Mapping[str, str | None] = field(repr=False)
    _datasets: Mapping[str, tuple[DatasetEntry, ...]] = field(repr=False)
    _allowed: Mapping[str, tuple[str, ...] | None] = field(repr=False)
    _digest: str = field(repr=False)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, partial: bool = False) -> Topology:
        """Parse a merged global config (plain dict, as ``OmegaConf.to_container(resolve=True)`` gives).

        Args:
            cfg: the merged config. It is deep-copied; later changes to it do not reach the topology.
            partial: ``cfg`` is only the run's own part of a config that a head server's completes (see
                :func:`gym_ray.config.run_config.resolve_run_config`): references and routing keys that
                name instances it does not define are not refused here, since the merged config is
                parsed again. Such a topology only checks the run's own blocks early.

        Returns:
            The immutable topology.

        Raises:
            ConfigError: a malformed instance, reference, dataset entry or routing key; ``key`` is the
                dotted path of the offending value.
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"the global config must be a mapping, got {type(cfg).__name__}")
        raw: dict[str, Any] = thaw(cfg)
        instances: dict[str, ServerInstance] = {}
        inners: dict[str, Mapping[str, Any]] = {}
        for name, value in raw.items():
            if isinstance(name, str) and isinstance(value, Mapping):
                parsed = parse_instance(name, value)
                if parsed is not None:
                    instances[name], inners[name] = parsed
        refs = {name: parse_references(inst, instances, partial=partial) for name, inst in instances.items()}
        bound = {name: bound_resources_server(inst, refs[name]) for name, inst in instances.items()}
        fronted: dict[str, tuple[str, ...]] = {}
        attributed: dict[str, str | None] = {}
        datasets: dict[str, tuple[DatasetEntry, ...]] = {}
        allowed: dict[str, tuple[str, ...] | None] = {}
        for name, inst in instances.items():
            if inst.server_type == keys.ENVIRONMENT_SERVERS:
                fronted[name], attributed[name] = fronts_of_env(refs[name])
            if inst.server_type in DATASET_DECLARERS:
                datasets[name] = parse_datasets(inst, inners[name])
            if inst.server_type == keys.RESOURCES_SERVERS:
                allowed[name] = parse_agent_types(
                    inners[name].get(keys.ALLOWED_AGENTS),
                    f"{name}.{inst.server_type}.{inst.implementation}.{keys.ALLOWED_AGENTS}",
                )
        envs = tuple(n for n, i in instances.items() if i.server_type == keys.ENVIRONMENT_SERVERS)
        routing = parse_routing(raw, envs, partial=partial)
        identity = {
            "instances": {
                name: {
                    "server_type": i.server_type,
                    "implementation": i.implementation,
                    "fields": thaw(i.fields),
                }
                for name, i in instances.items()
            },
            "routing": routing,
        }
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return cls(
            instances=MappingProxyType(instances),
            head_url=parse_head_url(raw),
            routes=MappingProxyType(routing[keys.ENVIRONMENT_SERVER_ROUTES]),
            routing_mode=routing[keys.ENVIRONMENT_ROUTING_MODE],
            environment_server_name=routing[keys.ENVIRONMENT_SERVER_NAME],
            agent_map=MappingProxyType(routing[keys.AGENT_MAP]),
            allow_unsupported_pairing=routing[keys.ALLOW_UNSUPPORTED_PAIRING],
            _raw=raw,
            _bound=MappingProxyType(bound),
            _fronted=MappingProxyType(fronted),
            _attributed=MappingProxyType(attributed),
            _datasets=MappingProxyType(datasets),
            _allowed=MappingProxyType(allowed),
            _digest=hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Shipped to Ray actors as parsed: the fields travel as plain dicts and are not parsed again.
        state = {
            name: dict(value) if isinstance(value, MappingProxyType) else value
            for name, value in vars(self).items()
        }
        return (_restore_topology, (state,))

    @property
    def raw(self) -> dict[str, Any]:
        """A fresh deep copy of the plain config this topology was built from."""
        return copy.deepcopy(self._raw)

    # --- instances ------------------------------------------------------------------------------
    def _names(self, server_type: str) -> tuple[str, ...]:
        return tuple(n for n, i in self.instances.items() if i.server_type == server_type)

    def agents(self) -> tuple[str, ...]:
        """Agent instance names (``responses_api_agents``), in config order."""
        return self._names(keys.RESPONSES_API_AGENTS)

    def resources_servers(self) -> tuple[str, ...]:
        """Resources server instance names, in config order."""
        return self._names(keys.RESOURCES_SERVERS)

    def environment_servers(self) -> tuple[str, ...]:
        """Environment server instance names, in config order."""
        return self._names(keys.ENVIRONMENT_SERVERS)

    def is_agent(self, name: str) -> bool:
        """True when ``name`` is an agent instance."""
        inst = self.instances.get(name)
        return inst is not None and inst.server_type == keys.RESPONSES_API_AGENTS

    def _require(
        self, name: str, server_type: str | None, error: type[ConfigError] = ConfigError
    ) -> ServerInstance:
        """The instance ``name`` (of ``server_type`` when given), else ``error`` with a hint."""
        inst = self.instances.get(name)
        if inst is not None and (server_type is None or inst.server_type == server_type):
            return inst
        label = LABELS[server_type]
        pool = self._names(server_type) if server_type else tuple(self.instances)
        if inst is not None:
            problem = f"{name!r} is {article(LABELS[inst.server_type])}, not {article(label)}"
        elif name in self._raw:
            problem = f"{name!r} is a setting of the config, not {article(label)}"
        else:
            problem = f"{name!r} is not {article(label)} of the config{did_you_mean(name, pool)}"
        raise error(f"{problem}; {label}s in the config: {listing(pool)}", key=name)

    def agent_type(self, agent: str) -> str:
        """The agent's *type*: its implementation key (``simple_agent``), not its instance name.

        Raises:
            ConfigError: ``agent`` is not an agent instance.
        """
        return self._require(agent, keys.RESPONSES_API_AGENTS).implementation

    def url_of(self, instance: str) -> str:
        """``"http://host:port"`` of an instance.

        Raises:
            ConfigError: no such instance.
        """
        return self._require(instance, None).url

    # --- environment servers and fronts -----------------------------------------------------------
    def fronted_agents(self, env: str) -> tuple[str, ...]:
        """Agents an environment server references (``responses_api_agents`` refs, ``agent_server``).

        Raises:
            ConfigError: ``env`` is not an environment server.
        """
        self._require(env, keys.ENVIRONMENT_SERVERS)
        return self._fronted[env]

    def attributed_agent(self, env: str) -> str | None:
        """``agent_server.name``, else the only agent it references, else None (e.g. a user simulator).

        Raises:
            ConfigError: ``env`` is not an environment server.
        """
        self._require(env, keys.ENVIRONMENT_SERVERS)
        return self._attributed[env]

    def resources_server_of(self, instance: str) -> str | None:
        """The resources server an agent or environment server binds (its ``resources_server`` field,
        else its only ``resources_servers`` reference), or None.

        Raises:
            ConfigError: no such instance.
        """
        self._require(instance, None)
        return self._bound[instance]

    def front_of(self, agent: str) -> str:
        """The one environment server that fronts ``agent``; the agent itself when none does.

        Raises:
            RoutingError: ``agent`` is not an agent, or two or more environment servers front it.
        """
        self._require(agent, keys.RESPONSES_API_AGENTS, RoutingError)
        fronts = sorted(env for env, agents in self._fronted.items() if agent in agents)
        if len(fronts) > 1:
            raise RoutingError(
                f"agent {agent!r} is fronted by several environment servers: {listing(fronts)}, so its rows "
                f"cannot be routed to exactly one; set {keys.ENVIRONMENT_ROUTING_MODE}=legacy with "
                f"{keys.ENVIRONMENT_SERVER_NAME}=<one of them>, route these rows by taskset, or stamp "
                f"{keys.ENVIRONMENT_SERVER} on the rows",
                key=agent,
            )
        return fronts[0] if fronts else agent

    def agents_of_resources_server(self, rs: str) -> tuple[str, ...]:
        """Agents whose bound resources server is ``rs``, in config order.

        Raises:
            ConfigError: ``rs`` is not a resources server.
        """
        self._require(rs, keys.RESOURCES_SERVERS)
        return tuple(a for a in self.agents() if self._bound[a] == rs)

    # --- datasets and pairing ---------------------------------------------------------------------
    def dataset_entries_of(self, instance: str) -> tuple[DatasetEntry, ...]:
        """The ``datasets:`` entries an instance declares (model servers declare none).

        Raises:
            ConfigError: no such instance.
        """
        self._require(instance, None)
        return self._datasets.get(instance, ())

    def all_dataset_entries(self) -> tuple[DatasetEntry, ...]:
        """Every dataset entry of the config, by declaring instance in config order."""
        return tuple(entry for entries in self._datasets.values() for entry in entries)

    def allowed_agents_of(self, instance: str) -> tuple[str, ...] | None:
        """The agent types a resources server accepts (its non-empty ``allowed_agents``), else None.

        Raises:
            ConfigError: no such instance.
        """
        self._require(instance, None)
        return self._allowed.get(instance)

    # --- routing ----------------------------------------------------------------------------------
    def env_server_for_taskset(self, taskset: str) -> str:
        """``environment_server_routes[taskset]``.

        Raises:
            RoutingError: no route for ``taskset``; names the routed tasksets.
        """
        env = self.routes.get(taskset)
        if env is not None:
            return env
        path = f"{keys.ENVIRONMENT_SERVER_ROUTES}.{taskset}"
        raise RoutingError(
            f"No environment server route is configured for taskset {taskset!r}"
            f"{did_you_mean(taskset, self.routes)}; routed tasksets: {listing(self.routes)}; add "
            f"+{path}=<environment server> (environment servers: {listing(self.environment_servers())})",
            key=path,
        )

    def environment_server_for_row(self, row: Mapping[str, Any]) -> str:
        """Where a row's ``/run`` goes: its ``_ng_environment_server`` stamp; else, for a materialized task
        row, its taskset's route (every mode); else, in ``legacy`` mode, ``environment_server_name``;
        else the front of its ``agent_ref.name``.

        Raises:
            RoutingError: the stamp is not an environment server, a materialized row has no routed taskset,
                a flat row meets ``taskset`` mode, the row names no agent, or the agent has no unique front.
        """
        stamp = row.get(keys.ENVIRONMENT_SERVER)
        envs = self.environment_servers()
        if stamp is not None:
            if stamp not in envs:
                raise RoutingError(
                    f"{_describe_row(row)} is stamped {keys.ENVIRONMENT_SERVER}={stamp!r}, which is not an "
                    f"environment server of the running config{did_you_mean(str(stamp), envs)}; "
                    f"environment servers: {listing(envs)}",
                    key=keys.ENVIRONMENT_SERVER,
                )
            return str(stamp)
        task_id = row.get(keys.TASK_ID)
        if isinstance(task_id, Mapping) and keys.TASK_INPUT in row:
            taskset = task_id.get(keys.TASKSET)
            if not isinstance(taskset, str) or not taskset:
                raise RoutingError(
                    f"{_describe_row(row)} is a materialized task row, but its task_id.taskset is "
                    f"{taskset!r}; set it to a routed taskset: {listing(self.routes)}",
                    key=keys.ENVIRONMENT_SERVER_ROUTES,
                )
            return self.env_server_for_taskset(taskset)
        if self.routing_mode == keys.ROUTING_LEGACY and self.environment_server_name is not None:
            return self.environment_server_name
        if self.routing_mode == keys.ROUTING_TASKSET:
            raise RoutingError(
                f"{_describe_row(row)} is a flat row, but {keys.ENVIRONMENT_ROUTING_MODE}=taskset routes "
                "only materialized task rows ({task_id: {taskset, task_id}, task_input}); use "
                f"{keys.ENVIRONMENT_ROUTING_MODE}=agent to mix flat and materialized rows",
                key=keys.ENVIRONMENT_ROUTING_MODE,
            )
        agent_ref = row.get(keys.AGENT_REF)
        agent = agent_ref.get(NAME) if isinstance(agent_ref, Mapping) else None
        if not isinstance(agent, str) or not agent:
            raise RoutingError(
                f"{_describe_row(row)} names no agent (agent_ref.name) and is not a materialized task row, "
                "so no environment server can be chosen; resolve its task_source first, set agent_ref, "
                f"or pass +{keys.AGENT_MAP}={{{keys.DEFAULT_KEY}: <agent>}}",
                key=keys.AGENT_REF,
            )
        return self.front_of(agent)

    def identity_digest(self) -> str:
        """sha256 hex of the parts that decide results: every instance's type, implementation and fields
        (not host/port, which change between runs) and the routing keys, as canonical sorted-key JSON."""
        return self._digest


def _restore_topology(state: dict[str, Any]) -> Topology:
    """Rebuild a pickled :class:`Topology` from its fields (see ``Topology.__reduce__``)."""
    proxied = {
        "instances",
        "routes",
        "agent_map",
        "_bound",
        "_fronted",
        "_attributed",
        "_datasets",
        "_allowed",
    }
    fields: dict[str, Any] = {k: MappingProxyType(v) if k in proxied else v for k, v in state.items()}
    return Topology(**fields)

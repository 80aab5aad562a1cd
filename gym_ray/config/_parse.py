"""Parsing the merged global config into checked pieces (PROTOCOL.md section 1).

The value types of a config (:class:`ServerRef`, :class:`DatasetEntry`, :class:`ServerInstance`) and the
checks that build them from plain config data: instance blocks, references between instances, ``datasets:``
entries, ``head_server`` and the routing keys. :class:`gym_ray.config.topology.Topology` assembles them and
re-exports the value types. Every check raises a :class:`~gym_ray.errors.ConfigError` whose ``key`` is the
dotted path of the offending value.

Concurrency: everything built here is deeply read-only (frozen dataclasses, ``MappingProxyType``, tuples),
so it may be shared by any number of threads and tasks.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gym_ray import keys
from gym_ray.errors import ConfigError

__all__ = [
    "DATASET_DECLARERS",
    "LABELS",
    "NAME",
    "DatasetEntry",
    "ServerInstance",
    "ServerRef",
    "article",
    "bound_resources_server",
    "did_you_mean",
    "freeze",
    "fronts_of_env",
    "listing",
    "parse_agent_types",
    "parse_datasets",
    "parse_head_url",
    "parse_instance",
    "parse_references",
    "parse_routing",
    "thaw",
]

_HOST = "host"
_PORT = "port"
NAME = "name"
_TYPE = "type"
#: OmegaConf's "mandatory value missing" marker: a reference naming it is unbound, not broken.
_UNBOUND = "???"
#: Fields whose name alone says what kind of instance they reference.
_IMPLIED_REF_TYPES: Mapping[str, str] = MappingProxyType(
    {
        keys.AGENT_SERVER: keys.RESPONSES_API_AGENTS,
        keys.RESOURCES_SERVER: keys.RESOURCES_SERVERS,
        keys.MODEL_SERVER: keys.RESPONSES_API_MODELS,
    }
)
DATASET_DECLARERS = (keys.RESPONSES_API_AGENTS, keys.RESOURCES_SERVERS, keys.ENVIRONMENT_SERVERS)
LABELS: Mapping[str | None, str] = MappingProxyType(
    {
        keys.RESPONSES_API_MODELS: "model server",
        keys.RESOURCES_SERVERS: "resources server",
        keys.RESPONSES_API_AGENTS: "agent",
        keys.ENVIRONMENT_SERVERS: "environment server",
        None: "server instance",
    }
)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A hint for a misspelt name.

    Args:
        name: the name that was not found.
        candidates: the names that exist.

    Returns:
        ``" (did you mean 'x'?)"`` for the closest candidate (difflib, cutoff 0.6), else ``""``.
    """
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def article(label: str) -> str:
    """``label`` with its indefinite article (``an agent``, ``a model server``)."""
    return f"an {label}" if label[0] in "aeiou" else f"a {label}"


def listing(names: Iterable[str]) -> str:
    """``names`` joined by commas, or ``none``."""
    joined = ", ".join(names)
    return joined or "none"


def freeze(value: Any, path: str) -> Any:
    """Deep read-only copy of plain config data; anything else is a ConfigError at ``path``."""
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"config key '{path}' has a non-string key {key!r}; write every mapping key as a string",
                    key=path,
                )
            frozen[key] = freeze(item, f"{path}.{key}")
        return MappingProxyType(frozen)
    if isinstance(value, list | tuple):
        return tuple(freeze(item, f"{path}.{i}") for i, item in enumerate(value))
    if value is None or isinstance(value, str | int | float):
        return value
    raise ConfigError(
        f"config key '{path}' holds a {type(value).__name__} value {value!r}; a config carries only "
        "strings, numbers, booleans, null, lists and mappings",
        key=path,
    )


def thaw(value: Any) -> Any:
    """Plain (mutable, JSON-ready) copy of a value made by ``freeze``."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [thaw(item) for item in value]
    return value


@dataclass(frozen=True)
class ServerRef:
    """A reference to another instance: ``{type: <server_type>, name: <instance>}``."""

    type: str
    name: str


@dataclass(frozen=True)
class DatasetEntry:
    """One item of an instance's ``datasets:`` list.

    Attributes:
        name: the dataset's name (required).
        type: ``train`` / ``validation`` / ``example`` / ``benchmark`` ..., or None.
        jsonl_fpath: where its rows live, or None.
        agent: the agent instance the dataset pins (``agent:``), or None.
        taskset: the taskset of a materialized dataset, or None.
        allowed_agents: agent types the entry accepts (a bare string is one entry), or None = any.
        num_repeats: the entry's repeat count (>= 1), or None.
        declared_by: the instance whose config lists the entry.
    """

    name: str
    type: str | None
    jsonl_fpath: str | None
    agent: str | None
    taskset: str | None
    allowed_agents: tuple[str, ...] | None
    num_repeats: int | None
    declared_by: str


@dataclass(frozen=True)
class ServerInstance:
    """One server instance of the config.

    Attributes:
        name: the top-level key.
        server_type: one of ``keys.SERVER_TYPES``.
        implementation: the implementation key (for an agent, its *agent type*, e.g. ``simple_agent``).
        host: where it listens, or None in a config written before addresses were assigned (such a
            config serves preprocessing and validation; dispatch needs the address).
        port: where it listens (0 = pick a free port when the reference servers start it), or None.
        fields: the implementation block minus ``host`` and ``port``, deeply read-only
            (mappings are ``MappingProxyType``, lists are tuples).
    """

    name: str
    server_type: str
    implementation: str
    host: str | None
    port: int | None
    fields: Mapping[str, Any]

    def __post_init__(self) -> None:
        path = f"{self.name}.{self.server_type}.{self.implementation}"
        object.__setattr__(self, "fields", freeze(self.fields, path))

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType does not pickle; rebuild from plain fields (__post_init__ freezes again).
        return (
            type(self),
            (self.name, self.server_type, self.implementation, self.host, self.port, thaw(self.fields)),
        )

    @property
    def url(self) -> str:
        """``"http://host:port"``.

        Raises:
            ConfigError: The instance has no host/port in the config (only dispatch needs them).
        """
        if self.host is None or self.port is None:
            path = f"{self.name}.{self.server_type}.{self.implementation}"
            raise ConfigError(
                f"server instance '{self.name}' has no address (config keys '{path}.host' and '{path}.port' "
                "are not set); dispatch needs it: give the head server's address (+head_server.host=... "
                "+head_server.port=...) or set host and port",
                key=path,
            )
        return f"http://{self.host}:{self.port}"


def _bad(path: str, text: str) -> ConfigError:
    return ConfigError(f"config key '{path}' {text}", key=path)


def _optional_address(block: Mapping[str, Any], path: str) -> tuple[str | None, int | None]:
    """An instance's host and port; both absent is allowed (a server YAML before ports are assigned)."""
    if block.get(_HOST) is None and block.get(_PORT) is None:
        return None, None
    return _require_address(block, path)


def _require_address(block: Mapping[str, Any], path: str) -> tuple[str, int]:
    host, port = block.get(_HOST), block.get(_PORT)
    if not isinstance(host, str) or not host:
        raise _bad(
            f"{path}.{_HOST}", f"must be a host name or address, got {host!r}; set it, e.g. to 127.0.0.1"
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise _bad(
            f"{path}.{_PORT}", f"must be an int TCP port in 0..65535, got {port!r}; set it, e.g. to 8000"
        )
    return host, port


def parse_instance(name: str, block: Mapping[str, Any]) -> tuple[ServerInstance, Mapping[str, Any]] | None:
    """The instance a top-level value describes (and its raw inner block), or None for a setting."""
    types = [key for key in block if key in keys.SERVER_TYPES]
    if not types:
        return None
    if len(types) > 1:
        raise _bad(name, f"holds several server types ({listing(types)}); give each its own top-level key")
    path = f"{name}.{types[0]}"
    impls = block[types[0]]
    if not isinstance(impls, Mapping) or len(impls) != 1:
        found = listing(str(k) for k in impls) if isinstance(impls, Mapping) else repr(impls)
        raise _bad(
            path,
            f"must hold exactly one implementation block (e.g. simple_agent: {{host, port}}), got {found}",
        )
    implementation, inner = next(iter(impls.items()))
    path = f"{path}.{implementation}"
    if not isinstance(inner, Mapping):
        raise _bad(path, f"must be a mapping with host and port, got {inner!r}")
    host, port = _optional_address(inner, path)
    fields = {key: value for key, value in inner.items() if key not in (_HOST, _PORT)}
    return ServerInstance(name, types[0], str(implementation), host, port, fields), inner


def _opt_str(entry: Mapping[str, Any], key: str, path: str) -> str | None:
    value = entry.get(key)
    if value is None or (isinstance(value, str) and value):
        return value
    raise _bad(f"{path}.{key}", f"must be a non-empty string or absent, got {value!r}; fix or remove it")


def parse_agent_types(value: Any, path: str) -> tuple[str, ...] | None:
    """``allowed_agents``: a list of agent types (a bare string is one); empty or absent = None."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) and i for i in items):
        raise _bad(path, f"must be a list of agent types (e.g. [simple_agent]), got {value!r}")
    return tuple(items) or None


def parse_datasets(inst: ServerInstance, inner: Mapping[str, Any]) -> tuple[DatasetEntry, ...]:
    """The ``datasets:`` entries of ``inst`` (``inner`` is its raw implementation block), in list order."""
    path = f"{inst.name}.{inst.server_type}.{inst.implementation}.{keys.DATASETS}"
    raw = inner.get(keys.DATASETS)
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise _bad(path, f"must be a list of dataset entries {{name, type, jsonl_fpath, ...}}, got {raw!r}")
    entries = []
    for index, entry in enumerate(raw):
        epath = f"{path}.{index}"
        if not isinstance(entry, Mapping):
            raise _bad(epath, f"must be a mapping {{name, type, jsonl_fpath, ...}}, got {entry!r}")
        name, repeats = entry.get(NAME), entry.get("num_repeats")
        if not isinstance(name, str) or not name:
            raise _bad(f"{epath}.{NAME}", f"must be the dataset's name (a non-empty string), got {name!r}")
        if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1):
            raise _bad(f"{epath}.num_repeats", f"must be an int >= 1 or absent, got {repeats!r}")
        entries.append(
            DatasetEntry(
                name=name,
                type=_opt_str(entry, _TYPE, epath),
                jsonl_fpath=_opt_str(entry, "jsonl_fpath", epath),
                agent=_opt_str(entry, "agent", epath),
                taskset=_opt_str(entry, keys.TASKSET, epath),
                allowed_agents=parse_agent_types(
                    entry.get(keys.ALLOWED_AGENTS), f"{epath}.{keys.ALLOWED_AGENTS}"
                ),
                num_repeats=repeats,
                declared_by=inst.name,
            )
        )
    return tuple(entries)


def parse_references(
    inst: ServerInstance, instances: Mapping[str, ServerInstance], *, partial: bool = False
) -> tuple[tuple[str, ServerRef], ...]:
    """``(field, ref)`` for every top-level field of ``inst`` that references another instance.

    With ``partial`` (the run's own part of a config a head server completes), a reference to an instance
    the config does not define is left out instead of refused: the merged config is checked again.
    """
    refs = []
    for fname, value in inst.fields.items():
        if not isinstance(value, Mapping):
            continue
        path = f"{inst.name}.{inst.server_type}.{inst.implementation}.{fname}"
        implied = _IMPLIED_REF_TYPES.get(fname)
        ref_type, ref_name = value.get(_TYPE, implied), value.get(NAME)
        if implied is not None and ref_type != implied:
            raise _bad(
                f"{path}.{_TYPE}",
                f"is {ref_type!r}, but '{fname}' references {article(LABELS[implied])}; set it to {implied}",
            )
        if ref_type not in keys.SERVER_TYPES or ref_name == _UNBOUND:
            continue
        label = LABELS[ref_type]
        pool = [n for n, i in instances.items() if i.server_type == ref_type]
        target = instances.get(ref_name) if isinstance(ref_name, str) else None
        if target is None and partial:
            continue
        if target is None:
            hint = did_you_mean(ref_name, pool) if isinstance(ref_name, str) else ""
            raise _bad(
                f"{path}.{NAME}",
                f"references {label} {ref_name!r}, which the config does not define"
                f"{hint}; {label}s in the config: {listing(pool)}",
            )
        if target.server_type != ref_type:
            raise _bad(
                path,
                f"references {ref_name!r} as {article(label)}, but {ref_name!r} is "
                f"{article(LABELS[target.server_type])}; point it at one of: {listing(pool)}",
            )
        refs.append((fname, ServerRef(ref_type, target.name)))
    return tuple(refs)


def bound_resources_server(inst: ServerInstance, refs: tuple[tuple[str, ServerRef], ...]) -> str | None:
    """The resources server ``inst`` binds: its ``resources_server`` field, else its only resources server
    reference, else None; several candidates without that field are a ConfigError."""
    named = [ref.name for fname, ref in refs if fname == keys.RESOURCES_SERVER]
    if named:
        return named[0]
    candidates = {ref.name: fname for fname, ref in refs if ref.type == keys.RESOURCES_SERVERS}
    if len(candidates) > 1:
        path = f"{inst.name}.{inst.server_type}.{inst.implementation}"
        raise _bad(
            path,
            f"references several resources servers (fields {listing(candidates.values())}) "
            f"and none under '{keys.RESOURCES_SERVER}'; name the verifier under "
            f"{path}.{keys.RESOURCES_SERVER}",
        )
    return next(iter(candidates), None)


def fronts_of_env(refs: tuple[tuple[str, ServerRef], ...]) -> tuple[tuple[str, ...], str | None]:
    """(fronted agents in field order, attributed agent) of an environment server."""
    names = tuple(dict.fromkeys(ref.name for _, ref in refs if ref.type == keys.RESPONSES_API_AGENTS))
    pinned = [ref.name for fname, ref in refs if fname == keys.AGENT_SERVER]
    if pinned:
        return names, pinned[0]
    return names, names[0] if len(names) == 1 else None


def _str_map(cfg: Mapping[str, Any], key: str) -> dict[str, str]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(key, f"must be a mapping of names, got {value!r}; write e.g. +{key}={{a: b}}")
    for name, target in value.items():
        if not isinstance(name, str) or not isinstance(target, str) or not target:
            raise _bad(f"{key}.{name}", f"must name an instance, got {target!r}")
    return dict(value)


def parse_head_url(cfg: Mapping[str, Any]) -> str | None:
    """``"http://host:port"`` of ``head_server``, or None when the config has none."""
    head = cfg.get(keys.HEAD_SERVER)
    if head is None:
        return None
    if not isinstance(head, Mapping):
        raise _bad(keys.HEAD_SERVER, f"must be {{host, port}}, got {head!r}")
    host, port = _require_address(head, keys.HEAD_SERVER)
    return f"http://{host}:{port}"


def parse_routing(raw: Mapping[str, Any], envs: tuple[str, ...], *, partial: bool = False) -> dict[str, Any]:
    """The routing keys, checked: routes, mode, environment_server_name, agent_map, pairing flag.

    With ``partial`` (the run's own part of a config a head server completes), routes and
    ``environment_server_name`` may name environment servers outside ``envs``: the merged config is
    checked again.
    """
    routes = _str_map(raw, keys.ENVIRONMENT_SERVER_ROUTES)
    for taskset, env in routes.items():
        if env not in envs and not partial:
            raise _bad(
                f"{keys.ENVIRONMENT_SERVER_ROUTES}.{taskset}",
                f"routes taskset {taskset!r} to {env!r}, which is not an environment server of the "
                f"config{did_you_mean(env, envs)}; environment servers: {listing(envs)}",
            )
    mode = raw.get(keys.ENVIRONMENT_ROUTING_MODE)
    mode = keys.ROUTING_AGENT if mode is None else mode
    if mode not in keys.ROUTING_MODES:
        raise _bad(
            keys.ENVIRONMENT_ROUTING_MODE,
            f"is {mode!r}; allowed values: {listing(keys.ROUTING_MODES)} (default {keys.ROUTING_AGENT})",
        )
    env_name = raw.get(keys.ENVIRONMENT_SERVER_NAME)
    if env_name is None and mode == keys.ROUTING_LEGACY:
        raise _bad(
            keys.ENVIRONMENT_SERVER_NAME,
            f"is not set, but {keys.ENVIRONMENT_ROUTING_MODE}=legacy sends "
            f"every flat row there; set it to one of: {listing(envs)}",
        )
    if env_name is not None and env_name not in envs and not partial:
        raise _bad(
            keys.ENVIRONMENT_SERVER_NAME,
            f"is {env_name!r}, which is not an environment server of the "
            f"config{did_you_mean(str(env_name), envs)}; environment servers: {listing(envs)}",
        )
    if mode == keys.ROUTING_TASKSET and not routes:
        raise _bad(
            keys.ENVIRONMENT_SERVER_ROUTES,
            f"is empty, but {keys.ENVIRONMENT_ROUTING_MODE}=taskset "
            f"routes rows by taskset; add +{keys.ENVIRONMENT_SERVER_ROUTES}.<taskset>=<environment server>",
        )
    pairing = raw.get(keys.ALLOW_UNSUPPORTED_PAIRING)
    pairing = False if pairing is None else pairing
    if not isinstance(pairing, bool):
        raise _bad(keys.ALLOW_UNSUPPORTED_PAIRING, f"must be true or false, got {pairing!r}")
    return {
        keys.ENVIRONMENT_SERVER_ROUTES: routes,
        keys.ENVIRONMENT_ROUTING_MODE: mode,
        keys.ENVIRONMENT_SERVER_NAME: env_name,
        keys.AGENT_MAP: _str_map(raw, keys.AGENT_MAP),
        keys.ALLOW_UNSUPPORTED_PAIRING: pairing,
    }

"""Topology: the global config as an immutable model, every lookup and every refusal."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from gym_ray.config.topology import DatasetEntry, ServerInstance, ServerRef, Topology, did_you_mean
from gym_ray.errors import ConfigError, RoutingError

AGENTS = "responses_api_agents"
RS = "resources_servers"
MODELS = "responses_api_models"
ENVS = "environment_servers"


def _ref(server_type: str, name: str) -> dict[str, str]:
    return {"type": server_type, "name": name}


def _base() -> dict[str, Any]:
    """Math verified by two harnesses (one fronted by a relay, one by a user simulator), plus an unfronted
    code agent."""
    return {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "policy_model_name": "stub-model",
        "policy_model": {MODELS: {"openai_model": {"host": "127.0.0.1", "port": 12000, "model": "stub"}}},
        "math": {
            RS: {
                "math_with_judge": {
                    "host": "127.0.0.1",
                    "port": 12001,
                    "allowed_agents": ["simple_agent"],
                    "datasets": [
                        {
                            "name": "math_train",
                            "type": "train",
                            "jsonl_fpath": "data/math.jsonl",
                            "agent": "math_simple_agent",
                            "allowed_agents": "simple_agent",
                            "num_repeats": 2,
                            "license": "MIT",
                        }
                    ],
                }
            }
        },
        "code": {RS: {"code_gen": {"host": "127.0.0.1", "port": 12002}}},
        "math_simple_agent": {
            AGENTS: {
                "simple_agent": {
                    "host": "127.0.0.1",
                    "port": 12003,
                    "resources_server": _ref(RS, "math"),
                    "model_server": _ref(MODELS, "policy_model"),
                    "datasets": [{"name": "math_example", "type": "example", "jsonl_fpath": "ex.jsonl"}],
                }
            }
        },
        "math_hermes_agent": {
            AGENTS: {
                "hermes_agent": {
                    "host": "127.0.0.1",
                    "port": 12004,
                    "resources_server": _ref(RS, "math"),
                    "model_server": _ref(MODELS, "policy_model"),
                }
            }
        },
        "user_agent": {
            AGENTS: {
                "simple_agent": {
                    "host": "127.0.0.1",
                    "port": 12005,
                    "model_server": _ref(MODELS, "policy_model"),
                }
            }
        },
        "code_agent": {
            AGENTS: {
                "simple_agent": {
                    "host": "127.0.0.1",
                    "port": 12006,
                    "resources_server": _ref(RS, "code"),
                    "model_server": _ref(MODELS, "policy_model"),
                }
            }
        },
        "math_environment_server": {
            ENVS: {
                "legacy_agent": {
                    "host": "127.0.0.1",
                    "port": 12007,
                    "agent_server": {"name": "math_simple_agent"},
                    "cleanup_timeout_seconds": 180,
                }
            }
        },
        "sim": {
            ENVS: {
                "nemo_user_sim": {
                    "host": "127.0.0.1",
                    "port": 12008,
                    "user_agent": _ref(AGENTS, "user_agent"),
                    "assistant_agent": _ref(AGENTS, "math_hermes_agent"),
                    "resources_server": _ref(RS, "math"),
                    "datasets": [{"name": "sim_val", "type": "validation", "taskset": "sim:val"}],
                }
            }
        },
        "environment_server_routes": {"sim:val": "sim"},
    }


def _topo(change: Callable[[dict[str, Any]], object] | None = None) -> Topology:
    cfg = _base()
    if change is not None:
        change(cfg)
    return Topology.from_config(cfg)


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _inner(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The implementation block of instance ``name``."""
    (impls,) = cfg[name].values()
    (inner,) = impls.values()
    assert isinstance(inner, dict)
    return inner


# --- did_you_mean -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "candidates", "expected"),
    [
        pytest.param(
            "simple_agnet", ["simple_agent", "math_agent"], " (did you mean 'simple_agent'?)", id="close"
        ),
        pytest.param("zzz", ["simple_agent"], "", id="nothing-close"),
        pytest.param("a", [], "", id="no-candidates"),
    ],
)
def test_did_you_mean(name: str, candidates: list[str], expected: str) -> None:
    assert did_you_mean(name, candidates) == expected


# --- instances ----------------------------------------------------------------------------------------


def test_instances_in_config_order_and_settings_ignored() -> None:
    topo = _topo()
    assert list(topo.instances) == [
        "policy_model",
        "math",
        "code",
        "math_simple_agent",
        "math_hermes_agent",
        "user_agent",
        "code_agent",
        "math_environment_server",
        "sim",
    ]
    assert topo.agents() == ("math_simple_agent", "math_hermes_agent", "user_agent", "code_agent")
    assert topo.resources_servers() == ("math", "code")
    assert topo.environment_servers() == ("math_environment_server", "sim")
    assert topo.head_url == "http://127.0.0.1:11000"


def test_server_instance_fields_exclude_address() -> None:
    inst = _topo().instances["math_simple_agent"]
    assert (inst.name, inst.server_type, inst.implementation, inst.host, inst.port) == (
        "math_simple_agent",
        AGENTS,
        "simple_agent",
        "127.0.0.1",
        12003,
    )
    assert inst.url == "http://127.0.0.1:12003"
    assert list(inst.fields) == ["resources_server", "model_server", "datasets"]
    assert inst.fields["resources_server"] == {"type": RS, "name": "math"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("math_simple_agent", True, id="agent"),
        pytest.param("math", False, id="resources-server"),
        pytest.param("policy_model_name", False, id="setting"),
        pytest.param("nope", False, id="absent"),
    ],
)
def test_is_agent(name: str, expected: bool) -> None:
    assert _topo().is_agent(name) is expected


def test_agent_type_is_the_implementation_key() -> None:
    topo = _topo()
    assert topo.agent_type("math_hermes_agent") == "hermes_agent"
    assert topo.agent_type("code_agent") == "simple_agent"


def test_url_of_and_head_absent() -> None:
    topo = _topo(lambda cfg: cfg.pop("head_server"))
    assert topo.url_of("sim") == "http://127.0.0.1:12008"
    assert topo.url_of("policy_model") == "http://127.0.0.1:12000"
    assert topo.head_url is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda t: t.agent_type("math"),
            "'math' is a resources server, not an agent; agents in the config: math_simple_agent, "
            "math_hermes_agent, user_agent, code_agent",
            id="agent-type-of-resources-server",
        ),
        pytest.param(
            lambda t: t.url_of("polcy_model"),
            "'polcy_model' is not a server instance of the config (did you mean 'policy_model'?); server "
            "instances in the config: policy_model, math, code, math_simple_agent, math_hermes_agent, "
            "user_agent, code_agent, math_environment_server, sim",
            id="url-of-unknown",
        ),
        pytest.param(
            lambda t: t.fronted_agents("policy_model_name"),
            "'policy_model_name' is a setting of the config, not an environment server; environment servers "
            "in the config: math_environment_server, sim",
            id="fronted-agents-of-setting",
        ),
        pytest.param(
            lambda t: t.attributed_agent("math_simple_agent"),
            "'math_simple_agent' is an agent, not an environment server; environment servers in the config: "
            "math_environment_server, sim",
            id="attributed-agent-of-agent",
        ),
        pytest.param(
            lambda t: t.agents_of_resources_server("maths"),
            "'maths' is not a resources server of the config (did you mean 'math'?); resources servers in "
            "the config: math, code",
            id="agents-of-unknown-resources-server",
        ),
        pytest.param(
            lambda t: t.dataset_entries_of("x"),
            "'x' is not a server instance of the config; server instances in the config: policy_model, "
            "math, code, math_simple_agent, math_hermes_agent, user_agent, code_agent, "
            "math_environment_server, sim",
            id="datasets-of-unknown",
        ),
    ],
)
def test_lookup_of_wrong_name_is_config_error(call: Callable[[Topology], object], message: str) -> None:
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        call(_topo())
    assert not isinstance(info.value, RoutingError)


# --- references, fronts, attribution ---------------------------------------------------------------


def test_fronted_and_attributed_agents() -> None:
    topo = _topo()
    assert topo.fronted_agents("math_environment_server") == ("math_simple_agent",)
    assert topo.attributed_agent("math_environment_server") == "math_simple_agent"
    assert topo.fronted_agents("sim") == ("user_agent", "math_hermes_agent")
    assert topo.attributed_agent("sim") is None


def test_attributed_agent_is_the_only_referenced_agent() -> None:
    def change(cfg: dict[str, Any]) -> None:
        cfg["code_env"] = {
            ENVS: {"single_agent_turn": {"host": "h", "port": 1, "harness": _ref(AGENTS, "code_agent")}}
        }

    topo = _topo(change)
    assert topo.fronted_agents("code_env") == ("code_agent",)
    assert topo.attributed_agent("code_env") == "code_agent"
    assert topo.front_of("code_agent") == "code_env"


def test_agent_server_wins_attribution_over_other_agent_refs() -> None:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, "sim")["agent_server"] = {"type": AGENTS, "name": "math_hermes_agent"}

    assert _topo(change).attributed_agent("sim") == "math_hermes_agent"


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        pytest.param("math_simple_agent", "math", id="agent"),
        pytest.param("code_agent", "code", id="other-agent"),
        pytest.param("sim", "math", id="environment-server"),
        pytest.param("user_agent", None, id="agent-without-verifier"),
        pytest.param("math_environment_server", None, id="relay-without-verifier"),
        pytest.param("policy_model", None, id="model-server"),
    ],
)
def test_resources_server_of(instance: str, expected: str | None) -> None:
    assert _topo().resources_server_of(instance) == expected


def test_resources_server_bound_through_a_typed_reference_field() -> None:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, "user_agent")["verifier"] = _ref(RS, "code")

    topo = _topo(change)
    assert topo.resources_server_of("user_agent") == "code"
    assert topo.agents_of_resources_server("code") == ("user_agent", "code_agent")


def test_agents_of_resources_server() -> None:
    topo = _topo()
    assert topo.agents_of_resources_server("math") == ("math_simple_agent", "math_hermes_agent")
    assert topo.agents_of_resources_server("code") == ("code_agent",)


def test_unbound_placeholder_reference_is_skipped() -> None:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, "user_agent")["resources_server"] = {"type": RS, "name": "???"}

    assert _topo(change).resources_server_of("user_agent") is None


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        pytest.param("math_simple_agent", "math_environment_server", id="relay"),
        pytest.param("math_hermes_agent", "sim", id="user-simulator"),
        pytest.param("code_agent", "code_agent", id="unfronted-agent-is-its-own-front"),
    ],
)
def test_front_of(agent: str, expected: str) -> None:
    assert _topo().front_of(agent) == expected


def test_front_of_agent_fronted_twice_is_routing_error() -> None:
    def change(cfg: dict[str, Any]) -> None:
        cfg["math_relay"] = {
            ENVS: {
                "legacy_agent": {"host": "h", "port": 1, "agent_server": _ref(AGENTS, "math_simple_agent")}
            }
        }

    message = (
        "agent 'math_simple_agent' is fronted by several environment servers: math_environment_server, "
        "math_relay, so its rows cannot be routed to exactly one; set environment_routing_mode=legacy with "
        "environment_server_name=<one of them>, route these rows by taskset, or stamp _ng_environment_server "
        "on the rows"
    )
    with pytest.raises(RoutingError, match=_exact(message)):
        _topo(change).front_of("math_simple_agent")


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        pytest.param(
            "math_simple_agnet",
            "'math_simple_agnet' is not an agent of the config (did you mean 'math_simple_agent'?); agents "
            "in the config: math_simple_agent, math_hermes_agent, user_agent, code_agent",
            id="unknown-with-hint",
        ),
        pytest.param(
            "math",
            "'math' is a resources server, not an agent; agents in the config: math_simple_agent, "
            "math_hermes_agent, user_agent, code_agent",
            id="resources-server",
        ),
    ],
)
def test_front_of_non_agent_is_routing_error(agent: str, message: str) -> None:
    with pytest.raises(RoutingError, match=_exact(message)) as info:
        _topo().front_of(agent)
    assert info.value.key == agent


# --- datasets and pairing ----------------------------------------------------------------------------


def test_dataset_entries() -> None:
    topo = _topo()
    math_train = DatasetEntry(
        name="math_train",
        type="train",
        jsonl_fpath="data/math.jsonl",
        agent="math_simple_agent",
        taskset=None,
        allowed_agents=("simple_agent",),
        num_repeats=2,
        declared_by="math",
    )
    example = DatasetEntry("math_example", "example", "ex.jsonl", None, None, None, None, "math_simple_agent")
    sim_val = DatasetEntry("sim_val", "validation", None, None, "sim:val", None, None, "sim")
    assert topo.dataset_entries_of("math") == (math_train,)
    assert topo.dataset_entries_of("math_simple_agent") == (example,)
    assert topo.dataset_entries_of("sim") == (sim_val,)
    assert topo.dataset_entries_of("code") == ()
    assert topo.all_dataset_entries() == (math_train, example, sim_val)


def test_datasets_on_model_servers_are_not_read() -> None:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, "policy_model")["datasets"] = [{"name": "x"}]

    topo = _topo(change)
    assert topo.dataset_entries_of("policy_model") == ()
    assert len(topo.all_dataset_entries()) == 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(["simple_agent", "hermes_agent"], ("simple_agent", "hermes_agent"), id="list"),
        pytest.param("simple_agent", ("simple_agent",), id="bare-string"),
        pytest.param([], None, id="empty"),
        pytest.param(None, None, id="null"),
    ],
)
def test_allowed_agents_of_resources_server(value: object, expected: tuple[str, ...] | None) -> None:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, "math")["allowed_agents"] = value

    assert _topo(change).allowed_agents_of("math") == expected


def test_allowed_agents_only_on_resources_servers() -> None:
    topo = _topo()
    assert topo.allowed_agents_of("code") is None
    assert topo.allowed_agents_of("math_simple_agent") is None


# --- routing ------------------------------------------------------------------------------------------


def test_routing_key_defaults() -> None:
    topo = _topo(lambda cfg: cfg.pop("environment_server_routes"))
    assert dict(topo.routes) == {}
    assert topo.routing_mode == "agent"
    assert topo.environment_server_name is None
    assert dict(topo.agent_map) == {}
    assert topo.allow_unsupported_pairing is False


def test_routing_keys_read() -> None:
    def change(cfg: dict[str, Any]) -> None:
        cfg.update(
            environment_routing_mode="legacy",
            environment_server_name="math_environment_server",
            agent_map={"math": "math_simple_agent", "_default": "code_agent"},
            allow_unsupported_pairing=True,
        )

    topo = _topo(change)
    assert dict(topo.routes) == {"sim:val": "sim"}
    assert topo.routing_mode == "legacy"
    assert topo.environment_server_name == "math_environment_server"
    assert dict(topo.agent_map) == {"math": "math_simple_agent", "_default": "code_agent"}
    assert topo.allow_unsupported_pairing is True


def test_env_server_for_taskset() -> None:
    topo = _topo()
    assert topo.env_server_for_taskset("sim:val") == "sim"
    message = (
        "No environment server route is configured for taskset 'sim:vall' (did you mean 'sim:val'?); routed "
        "tasksets: sim:val; add +environment_server_routes.sim:vall=<environment server> (environment "
        "servers: math_environment_server, sim)"
    )
    with pytest.raises(RoutingError, match=_exact(message)) as info:
        topo.env_server_for_taskset("sim:vall")
    assert info.value.key == "environment_server_routes.sim:vall"


MATERIALIZED = {"task_id": {"taskset": "sim:val", "task_id": "t7"}, "task_input": {"persona": "x"}}


@pytest.mark.parametrize(
    ("mode", "row", "expected"),
    [
        pytest.param(
            "agent", {"agent_ref": {"name": "math_simple_agent"}}, "math_environment_server", id="front"
        ),
        pytest.param("agent", {"agent_ref": {"name": "code_agent"}}, "code_agent", id="own-front"),
        pytest.param(
            "agent",
            {"agent_ref": {"name": "math_simple_agent"}, "_ng_environment_server": "sim"},
            "sim",
            id="stamp-wins",
        ),
        pytest.param("agent", MATERIALIZED, "sim", id="materialized"),
        pytest.param("legacy", MATERIALIZED, "sim", id="materialized-in-legacy-mode"),
        pytest.param("taskset", MATERIALIZED, "sim", id="materialized-in-taskset-mode"),
        pytest.param("legacy", {"agent_ref": {"name": "code_agent"}}, "math_environment_server", id="legacy"),
        pytest.param("legacy", {"task_source": "math"}, "math_environment_server", id="legacy-without-agent"),
    ],
)
def test_environment_server_for_row(mode: str, row: dict[str, Any], expected: str) -> None:
    def change(cfg: dict[str, Any]) -> None:
        cfg.update(environment_routing_mode=mode, environment_server_name="math_environment_server")

    assert _topo(change).environment_server_for_row(row) == expected


@pytest.mark.parametrize(
    ("mode", "row", "message"),
    [
        pytest.param(
            "agent",
            {"_ng_environment_server": "simm", "_ng_task_index": 3},
            "row (_ng_task_index=3) is stamped _ng_environment_server='simm', which is not an environment "
            "server of the running config (did you mean 'sim'?); environment servers: "
            "math_environment_server, sim",
            id="unknown-stamp",
        ),
        pytest.param(
            "agent",
            {"task_id": {"taskset": "other", "task_id": "1"}, "task_input": {}},
            "No environment server route is configured for taskset 'other'; routed tasksets: sim:val; add "
            "+environment_server_routes.other=<environment server> (environment servers: "
            "math_environment_server, sim)",
            id="unrouted-taskset",
        ),
        pytest.param(
            "agent",
            {"task_id": {"task_id": "1"}, "task_input": {}, "_ng_task_index": 0, "_ng_rollout_index": 2},
            "row (_ng_task_index=0, _ng_rollout_index=2) is a materialized task row, but its task_id.taskset "
            "is None; set it to a routed taskset: sim:val",
            id="materialized-without-taskset",
        ),
        pytest.param(
            "taskset",
            {"agent_ref": {"name": "code_agent"}},
            "row is a flat row, but environment_routing_mode=taskset routes only materialized task rows "
            "({task_id: {taskset, task_id}, task_input}); use environment_routing_mode=agent to mix flat and "
            "materialized rows",
            id="flat-row-in-taskset-mode",
        ),
        pytest.param(
            "agent",
            {"task_source": "math", "_ng_task_index": 5},
            "row (_ng_task_index=5) names no agent (agent_ref.name) and is not a materialized task row, so "
            "no environment server can be chosen; resolve its task_source first, set agent_ref, or pass "
            "+agent_map={_default: <agent>}",
            id="no-agent",
        ),
        pytest.param(
            "agent",
            {"agent_ref": {"name": "cod_agent"}},
            "'cod_agent' is not an agent of the config (did you mean 'code_agent'?); agents in the config: "
            "math_simple_agent, math_hermes_agent, user_agent, code_agent",
            id="unknown-agent",
        ),
    ],
)
def test_environment_server_for_row_refusals(mode: str, row: dict[str, Any], message: str) -> None:
    def change(cfg: dict[str, Any]) -> None:
        cfg["environment_routing_mode"] = mode

    with pytest.raises(RoutingError, match=_exact(message)):
        _topo(change).environment_server_for_row(row)


# --- malformed configs -------------------------------------------------------------------------------


def _set(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(cfg: dict[str, Any]) -> None:
        cfg[name] = value

    return change


def _set_field(instance: str, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(cfg: dict[str, Any]) -> None:
        _inner(cfg, instance)[key] = value

    return change


MATH_AGENT = "math_simple_agent.responses_api_agents.simple_agent"
MATH_RS = "math.resources_servers.math_with_judge"


@pytest.mark.parametrize(
    ("change", "key", "message"),
    [
        pytest.param(
            _set("bad", {AGENTS: {"a": {}}, RS: {"b": {}}}),
            "bad",
            "config key 'bad' holds several server types (responses_api_agents, resources_servers); give "
            "each its own top-level key",
            id="two-server-types",
        ),
        pytest.param(
            _set("bad", {RS: {}}),
            "bad.resources_servers",
            "config key 'bad.resources_servers' must hold exactly one implementation block (e.g. "
            "simple_agent: {host, port}), got none",
            id="no-implementation",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"host": "h", "port": 1}, "b": {"host": "h", "port": 2}}}),
            "bad.resources_servers",
            "config key 'bad.resources_servers' must hold exactly one implementation block (e.g. "
            "simple_agent: {host, port}), got a, b",
            id="two-implementations",
        ),
        pytest.param(
            _set("bad", {RS: {"a": 5}}),
            "bad.resources_servers.a",
            "config key 'bad.resources_servers.a' must be a mapping with host and port, got 5",
            id="implementation-not-a-mapping",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"port": 1}}}),
            "bad.resources_servers.a.host",
            "config key 'bad.resources_servers.a.host' must be a host name or address, got None; set it, "
            "e.g. to 127.0.0.1",
            id="missing-host",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"host": "h"}}}),
            "bad.resources_servers.a.port",
            "config key 'bad.resources_servers.a.port' must be an int TCP port in 0..65535, got None; set "
            "it, e.g. to 8000",
            id="missing-port",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"host": "h", "port": "8000"}}}),
            "bad.resources_servers.a.port",
            "config key 'bad.resources_servers.a.port' must be an int TCP port in 0..65535, got '8000'; set "
            "it, e.g. to 8000",
            id="port-a-string",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"host": "h", "port": True}}}),
            "bad.resources_servers.a.port",
            "config key 'bad.resources_servers.a.port' must be an int TCP port in 0..65535, got True; set "
            "it, e.g. to 8000",
            id="port-a-bool",
        ),
        pytest.param(
            _set("bad", {RS: {"a": {"host": "h", "port": 70000}}}),
            "bad.resources_servers.a.port",
            "config key 'bad.resources_servers.a.port' must be an int TCP port in 0..65535, got 70000; set "
            "it, e.g. to 8000",
            id="port-out-of-range",
        ),
        pytest.param(
            _set_field("math_simple_agent", "resources_server", _ref(RS, "maht")),
            f"{MATH_AGENT}.resources_server.name",
            f"config key '{MATH_AGENT}.resources_server.name' references resources server 'maht', which the "
            "config does not define (did you mean 'math'?); resources servers in the config: math, code",
            id="unknown-reference",
        ),
        pytest.param(
            _set_field("math_environment_server", "agent_server", {"name": 5}),
            "math_environment_server.environment_servers.legacy_agent.agent_server.name",
            "config key 'math_environment_server.environment_servers.legacy_agent.agent_server.name' "
            "references agent 5, which the config does not define; agents in the config: math_simple_agent, "
            "math_hermes_agent, user_agent, code_agent",
            id="reference-name-not-a-string",
        ),
        pytest.param(
            _set_field("math_simple_agent", "model_server", _ref(MODELS, "math")),
            f"{MATH_AGENT}.model_server",
            f"config key '{MATH_AGENT}.model_server' references 'math' as a model server, but 'math' is a "
            "resources server; point it at one of: policy_model",
            id="reference-to-wrong-type",
        ),
        pytest.param(
            _set_field("sim", "helper", _ref(AGENTS, "code")),
            "sim.environment_servers.nemo_user_sim.helper",
            "config key 'sim.environment_servers.nemo_user_sim.helper' references 'code' as an agent, but "
            "'code' is a resources server; point it at one of: math_simple_agent, math_hermes_agent, "
            "user_agent, code_agent",
            id="agent-reference-to-resources-server",
        ),
        pytest.param(
            _set_field("math_simple_agent", "resources_server", _ref(AGENTS, "code_agent")),
            f"{MATH_AGENT}.resources_server.type",
            f"config key '{MATH_AGENT}.resources_server.type' is 'responses_api_agents', but "
            "'resources_server' references a resources server; set it to resources_servers",
            id="named-field-with-wrong-type",
        ),
        pytest.param(
            lambda cfg: _inner(cfg, "user_agent").update(a=_ref(RS, "math"), b=_ref(RS, "code")),
            "user_agent.responses_api_agents.simple_agent",
            "config key 'user_agent.responses_api_agents.simple_agent' references several resources servers "
            "(fields a, b) and none under 'resources_server'; name the verifier under "
            "user_agent.responses_api_agents.simple_agent.resources_server",
            id="ambiguous-verifier",
        ),
        pytest.param(
            _set_field("math", "datasets", {"name": "x"}),
            f"{MATH_RS}.datasets",
            f"config key '{MATH_RS}.datasets' must be a list of dataset entries {{name, type, jsonl_fpath, "
            "...}, got {'name': 'x'}",
            id="datasets-not-a-list",
        ),
        pytest.param(
            _set_field("math", "datasets", ["x"]),
            f"{MATH_RS}.datasets.0",
            f"config key '{MATH_RS}.datasets.0' must be a mapping {{name, type, jsonl_fpath, ...}}, got 'x'",
            id="dataset-not-a-mapping",
        ),
        pytest.param(
            _set_field("math", "datasets", [{"name": "a"}, {"type": "train"}]),
            f"{MATH_RS}.datasets.1.name",
            f"config key '{MATH_RS}.datasets.1.name' must be the dataset's name (a non-empty string), "
            "got None",
            id="dataset-without-name",
        ),
        pytest.param(
            _set_field("math", "datasets", [{"name": "a", "num_repeats": 0}]),
            f"{MATH_RS}.datasets.0.num_repeats",
            f"config key '{MATH_RS}.datasets.0.num_repeats' must be an int >= 1 or absent, got 0",
            id="dataset-num-repeats-zero",
        ),
        pytest.param(
            _set_field("math", "datasets", [{"name": "a", "taskset": ""}]),
            f"{MATH_RS}.datasets.0.taskset",
            f"config key '{MATH_RS}.datasets.0.taskset' must be a non-empty string or absent, got ''; fix or "
            "remove it",
            id="dataset-empty-taskset",
        ),
        pytest.param(
            _set_field("math", "allowed_agents", 5),
            f"{MATH_RS}.allowed_agents",
            f"config key '{MATH_RS}.allowed_agents' must be a list of agent types (e.g. [simple_agent]), "
            "got 5",
            id="allowed-agents-not-a-list",
        ),
        pytest.param(
            _set_field("math", "tags", {1, 2}),
            f"{MATH_RS}.tags",
            f"config key '{MATH_RS}.tags' holds a set value {{1, 2}}; a config carries only strings, "
            "numbers, booleans, null, lists and mappings",
            id="field-not-plain-data",
        ),
        pytest.param(
            _set_field("math", "judge", {1: "x"}),
            f"{MATH_RS}.judge",
            f"config key '{MATH_RS}.judge' has a non-string key 1; write every mapping key as a string",
            id="field-with-non-string-key",
        ),
        pytest.param(
            _set("environment_server_routes", {"t": "math_simple_agent"}),
            "environment_server_routes.t",
            "config key 'environment_server_routes.t' routes taskset 't' to 'math_simple_agent', which is "
            "not an environment server of the config; environment servers: math_environment_server, sim",
            id="route-to-agent",
        ),
        pytest.param(
            _set("environment_server_routes", ["sim"]),
            "environment_server_routes",
            "config key 'environment_server_routes' must be a mapping of names, got ['sim']; write e.g. "
            "+environment_server_routes={a: b}",
            id="routes-not-a-mapping",
        ),
        pytest.param(
            _set("environment_routing_mode", "agents"),
            "environment_routing_mode",
            "config key 'environment_routing_mode' is 'agents'; allowed values: agent, legacy, taskset "
            "(default agent)",
            id="bad-mode",
        ),
        pytest.param(
            _set("environment_routing_mode", "legacy"),
            "environment_server_name",
            "config key 'environment_server_name' is not set, but environment_routing_mode=legacy sends "
            "every flat row there; set it to one of: math_environment_server, sim",
            id="legacy-without-name",
        ),
        pytest.param(
            _set("environment_server_name", "sims"),
            "environment_server_name",
            "config key 'environment_server_name' is 'sims', which is not an environment server of the "
            "config (did you mean 'sim'?); environment servers: math_environment_server, sim",
            id="unknown-environment-server-name",
        ),
        pytest.param(
            lambda cfg: cfg.update(environment_routing_mode="taskset", environment_server_routes={}),
            "environment_server_routes",
            "config key 'environment_server_routes' is empty, but environment_routing_mode=taskset routes "
            "rows by taskset; add +environment_server_routes.<taskset>=<environment server>",
            id="taskset-mode-without-routes",
        ),
        pytest.param(
            _set("agent_map", {"math": 3}),
            "agent_map.math",
            "config key 'agent_map.math' must name an instance, got 3",
            id="agent-map-value-not-a-name",
        ),
        pytest.param(
            _set("allow_unsupported_pairing", "yes"),
            "allow_unsupported_pairing",
            "config key 'allow_unsupported_pairing' must be true or false, got 'yes'",
            id="pairing-flag-not-a-bool",
        ),
        pytest.param(
            _set("head_server", {"host": "127.0.0.1"}),
            "head_server.port",
            "config key 'head_server.port' must be an int TCP port in 0..65535, got None; set it, e.g. "
            "to 8000",
            id="head-server-without-port",
        ),
        pytest.param(
            _set("head_server", "127.0.0.1:11000"),
            "head_server",
            "config key 'head_server' must be {host, port}, got '127.0.0.1:11000'",
            id="head-server-not-a-mapping",
        ),
    ],
)
def test_malformed_config_is_refused(
    change: Callable[[dict[str, Any]], object], key: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        _topo(change)
    assert info.value.key == key
    assert not isinstance(info.value, RoutingError)


def test_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match=_exact("the global config must be a mapping, got list")):
        Topology.from_config([])  # type: ignore[arg-type]


# --- immutability, pickling, identity --------------------------------------------------------------


def test_topology_is_immutable_and_detached_from_its_input() -> None:
    cfg = _base()
    topo = Topology.from_config(cfg)
    _inner(cfg, "math_simple_agent")["resources_server"]["name"] = "code"
    cfg["environment_server_routes"]["new"] = "sim"
    assert topo.resources_server_of("math_simple_agent") == "math"
    assert dict(topo.routes) == {"sim:val": "sim"}
    raw = topo.raw
    assert raw == _base()
    raw["math"] = None
    assert topo.raw == _base()
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.routing_mode = "legacy"  # type: ignore[misc]
    with pytest.raises(TypeError):
        topo.routes["x"] = "sim"  # type: ignore[index]
    with pytest.raises(TypeError):
        topo.instances["math_simple_agent"].fields["resources_server"]["name"] = "x"  # type: ignore[index]
    assert topo.instances["math"].fields["datasets"][0]["num_repeats"] == 2
    assert isinstance(topo.instances["math"].fields["allowed_agents"], tuple)


def test_server_instance_built_directly_freezes_its_fields() -> None:
    fields: dict[str, Any] = {"datasets": [{"name": "d"}], "resources_server": {"type": RS, "name": "rs"}}
    inst = ServerInstance("ag", AGENTS, "simple_agent", "127.0.0.1", 8000, fields)
    fields["datasets"].append({"name": "e"})
    assert inst.fields["datasets"] == ({"name": "d"},)
    assert pickle.loads(pickle.dumps(inst)) == inst
    assert ServerRef(RS, "rs") == ServerRef(type=RS, name="rs")


def test_topology_pickles() -> None:
    topo = _topo()
    clone = pickle.loads(pickle.dumps(topo))
    assert clone.raw == topo.raw
    assert clone.identity_digest() == topo.identity_digest()
    assert clone.front_of("math_hermes_agent") == "sim"


def _moved_ports(cfg: dict[str, Any]) -> None:
    for name in ("math", "sim", "policy_model"):
        _inner(cfg, name)["port"] += 1000
    _inner(cfg, "sim")["host"] = "10.0.0.7"
    cfg["head_server"]["port"] = 1


def _reordered(cfg: dict[str, Any]) -> None:
    items = list(cfg.items())
    cfg.clear()
    cfg.update(reversed(items))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_moved_ports, id="hosts-and-ports"),
        pytest.param(_reordered, id="key-order"),
        pytest.param(_set("policy_model_name", "other"), id="non-routing-setting"),
        pytest.param(_set("environment_routing_mode", "agent"), id="explicit-default-mode"),
    ],
)
def test_identity_digest_ignores(change: Callable[[dict[str, Any]], object]) -> None:
    digest = _topo().identity_digest()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert _topo(change).identity_digest() == digest


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_set_field("math", "allowed_agents", ["hermes_agent"]), id="implementation-field"),
        pytest.param(_set_field("policy_model", "model", "other"), id="model-field"),
        pytest.param(_set("environment_server_routes", {"sim:test": "sim"}), id="routes"),
        pytest.param(_set("agent_map", {"_default": "code_agent"}), id="agent-map"),
        pytest.param(_set("allow_unsupported_pairing", True), id="pairing-flag"),
        pytest.param(_set("environment_server_name", "sim"), id="environment-server-name"),
        pytest.param(_set("extra", {RS: {"math_with_judge": {"host": "h", "port": 1}}}), id="added-instance"),
    ],
)
def test_identity_digest_changes_with(change: Callable[[dict[str, Any]], object]) -> None:
    assert _topo(change).identity_digest() != _topo().identity_digest()


# --- a config shaped like a live NeMo Gym 0.7 deployment --------------------------------------------

NEMO_GYM_07 = """
head_server: {host: 127.0.0.1, port: 18100}
policy_base_url: http://127.0.0.1:18000/v1
policy_api_key: dummy
policy_model_name: stub-model
policy_model:
  responses_api_models:
    openai_model:
      entrypoint: app.py
      openai_base_url: http://127.0.0.1:18000/v1
      openai_api_key: dummy
      openai_model: stub-model
      host: 127.0.0.1
      port: 18101
example_single_tool_call:
  resources_servers:
    example_single_tool_call:
      entrypoint: app.py
      domain: agent
      host: 127.0.0.1
      port: 18102
example_single_tool_call_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: example_single_tool_call}
      model_server: {type: responses_api_models, name: policy_model}
      datasets:
      - name: example
        type: example
        jsonl_fpath: resources_servers/example_single_tool_call/data/example.jsonl
      host: 127.0.0.1
      port: 18103
example_single_tool_call_environment_server:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      agent_server: {type: responses_api_agents, name: example_single_tool_call_simple_agent}
      max_concurrent_episodes: null
      queue_timeout_seconds: null
      default_episode_timeout_seconds: 21600
      cleanup_timeout_seconds: 180
      host: 127.0.0.1
      port: 18104
"""

#: The request row of a real ``POST http://127.0.0.1:18104/run`` (reference/wire), input shortened.
WIRE_ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "what's it like in sf? (task 0)"}]},
    "agent_ref": {"name": "example_single_tool_call_simple_agent"},
    "_ng_task_index": 0,
    "_ng_rollout_index": 0,
}


def test_nemo_gym_07_deployment() -> None:
    topo = Topology.from_config(yaml.safe_load(NEMO_GYM_07))
    agent, env, rs = (
        "example_single_tool_call_simple_agent",
        "example_single_tool_call_environment_server",
        "example_single_tool_call",
    )
    assert topo.head_url == "http://127.0.0.1:18100"
    assert topo.agents() == (agent,)
    assert topo.environment_servers() == (env,)
    assert topo.resources_servers() == (rs,)
    assert topo.agent_type(agent) == "simple_agent"
    assert topo.instances[env].implementation == "legacy_agent"
    assert topo.fronted_agents(env) == (agent,)
    assert topo.attributed_agent(env) == agent
    assert topo.front_of(agent) == env
    assert topo.resources_server_of(agent) == rs
    assert topo.resources_server_of(env) is None
    assert topo.agents_of_resources_server(rs) == (agent,)
    assert topo.allowed_agents_of(rs) is None
    assert [(e.name, e.declared_by) for e in topo.dataset_entries_of(agent)] == [("example", agent)]
    row = copy.deepcopy(WIRE_ROW)
    server = topo.environment_server_for_row(row)
    assert server == env
    assert topo.url_of(server) + "/run" == "http://127.0.0.1:18104/run"
    assert row == WIRE_ROW

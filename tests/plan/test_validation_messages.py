"""Each error ``validate_rows`` raises, word for word: the problem, the rows it names, what to do, the key.

The expected texts are written out by hand from PROTOCOL.md section 4's rules and the config below.
"""

from __future__ import annotations

from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.errors import RoutingError, ValidationError
from gym_ray.plan.validation import validate_rows
from tests.plan.test_preprocess_validation import (
    AGENTS,
    ENVS,
    RS,
    TOPOLOGY,
    _agent,
    _rs,
    _server,
    config,
    flat,
    named,
    task_row,
)

_ROUTING_TAIL = "Fix the stamps or environment_server_routes in the config, or re-preprocess the rows."
_DISAGREE_TAIL = (
    "Include the agents' configs in the run or re-route the rows with agent_map; for a pairing the "
    "verifier does not accept, route the rows to an accepted agent or set allow_unsupported_pairing=true."
)
# An environment server whose resources server ('math': simple_agent only) rejects its own agent's type.
_ENV_TOOL = _server(
    ENVS,
    "nemo_user_sim",
    user=_agent("tool_agent"),
    assistant=_agent("tool_agent"),
    resources_server=_rs("math"),
)
# An agent declaring a taskset (routed to env_math) that only hermes_agent may run.
_DECLARER = _server(
    AGENTS,
    "simple_agent",
    datasets=[{"name": "plain", "taskset": "plain:x", "allowed_agents": ["hermes_agent"]}],
)
# No environment servers at all.
_NO_ENVS = {
    "math": _server(RS, "math_with_judge"),
    "math_simple_agent": _server(AGENTS, "simple_agent", resources_server=_rs("math")),
    "policy_base_url": "http://127.0.0.1:9",
}

# (rows, topology, error type, its key, its exact message)
CASES: dict[str, tuple[list[Any], Topology, type[Exception], str | None, str]] = {
    "taskset-without-route": (
        [task_row("sim:vol", "t1")],
        TOPOLOGY,
        RoutingError,
        "environment_server_routes",
        "Rows cannot be routed to their environment server:\n"
        "  - taskset 'sim:vol' has no environment_server_routes entry (did you mean 'sim:val'?) "
        f"[row 0 (task_id sim:vol/t1)]\n{_ROUTING_TAIL}",
    ),
    "no-environment-servers-at-all": (
        [flat("q", _ng_environment_server="env_x")],
        Topology.from_config(_NO_ENVS),
        RoutingError,
        "environment_server_routes",
        "Rows cannot be routed to their environment server:\n"
        "  - environment server 'env_x' is not in the running config; environment servers: none [row 0]\n"
        f"{_ROUTING_TAIL}",
    ),
    "row-not-an-object": (
        [["x"]],
        TOPOLOGY,
        ValidationError,
        None,
        "Rows disagree with the running config:\n"
        f"  - unknown agent: the row is a list, not an object [row 0]\n{_DISAGREE_TAIL}",
    ),
    "unknown-agent-then-pairing": (
        [named("ghost"), named("tool_agent", task_source="math")],
        TOPOLOGY,
        ValidationError,
        None,
        "Rows disagree with the running config:\n"
        "  - unknown agent: 'ghost' is not in the running config [row 0]\n"
        "  - unsupported pairing: rows run agent 'tool_agent' (type 'tool_agent'), but their task_source "
        f"'math' accepts only: simple_agent [row 1]\n{_DISAGREE_TAIL}",
    ),
    "pairing-refused-by-the-environment-servers-resources-server": (
        [flat("q", _ng_environment_server="env_tool")],
        Topology.from_config(config(env_tool=_ENV_TOOL)),
        ValidationError,
        None,
        "Rows disagree with the running config:\n"
        "  - unsupported pairing: rows run agent 'tool_agent' (type 'tool_agent'), but the resources server "
        f"'math' of environment server 'env_tool' accepts only: simple_agent [row 0]\n{_DISAGREE_TAIL}",
    ),
    "agent-not-fronted-by-its-stamped-server": (
        [named("math_simple_agent", _ng_environment_server="env_sim")],
        TOPOLOGY,
        RoutingError,
        "environment_server_routes",
        "Rows cannot be routed to their environment server:\n"
        "  - agent 'math_simple_agent' is not fronted by its environment server 'env_sim', which fronts: "
        f"pinned_a, pinned_b [row 0]\n{_ROUTING_TAIL}",
    ),
    "row-without-agent-or-stamp": (
        [flat("q", _ng_task_index=2, _ng_rollout_index=0)],
        TOPOLOGY,
        ValidationError,
        None,
        "Rows disagree with the running config:\n"
        "  - unknown agent: the row has no agent_ref and no environment server stamp; resolve its "
        f"task_source or preprocess it with agent_map [row 0 (task 2, rollout 0)]\n{_DISAGREE_TAIL}",
    ),
    "pairing-refused-by-the-taskset-entry-of-another-agent": (
        [task_row("plain:x", "t1")],
        Topology.from_config(
            config(
                environment_server_routes={
                    "sim:val": "env_sim",
                    "harbor:test": "env_harbor",
                    "plain:x": "env_math",
                },
                declarer=_DECLARER,
            )
        ),
        ValidationError,
        None,
        "Rows disagree with the running config:\n"
        "  - unsupported pairing: rows run agent 'math_simple_agent' (type 'simple_agent'), but dataset "
        "entry 'plain' declared by 'declarer' accepts only: hermes_agent [row 0 (task_id plain:x/t1)]\n"
        + _DISAGREE_TAIL,
    ),
    "agent-without-a-unique-front": (
        [named("dual_agent")],
        TOPOLOGY,
        RoutingError,
        "environment_routing_mode",
        "Rows cannot be routed: their agent has no unique environment server:\n"
        "  - agent 'dual_agent' is fronted by several environment servers: env_dual1, env_dual2, so its rows "
        "cannot be routed to exactly one; set environment_routing_mode=legacy with "
        "environment_server_name=<one of them>, route these rows by taskset, or stamp _ng_environment_server "
        "on the rows [row 0]\n"
        "Set environment_routing_mode=legacy with environment_server_name, or route the rows by taskset.",
    ),
}


@pytest.mark.parametrize(
    ("rows", "topology", "error", "key", "message"), list(CASES.values()), ids=list(CASES)
)
def test_each_validation_error_is_its_exact_message(
    rows: list[Any], topology: Topology, error: type[Exception], key: str | None, message: str
) -> None:
    with pytest.raises(error) as caught:
        validate_rows(rows, topology)
    assert type(caught.value) is error
    assert str(caught.value) == message
    assert getattr(caught.value, "key", None) == key
    if isinstance(caught.value, ValidationError):
        assert caught.value.problems == [line.removeprefix("  - ") for line in message.split("\n")[1:-1]]

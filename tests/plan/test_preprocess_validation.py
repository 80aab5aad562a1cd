"""preprocess: resolve_task_sources, stamp_environment_agent_refs and validate_rows against a real
Topology built from a config that has every shape the rules distinguish."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.errors import RoutingError, ValidationError
from gym_ray.plan.validation import (
    MAX_LISTED_ROWS,
    resolve_task_sources,
    stamp_environment_agent_refs,
    validate_rows,
)

RS, AGENTS, ENVS = "resources_servers", "responses_api_agents", "environment_servers"


def _server(server_type: str, impl: str, **fields: Any) -> dict[str, Any]:
    return {server_type: {impl: {"host": "127.0.0.1", "port": 0, **fields}}}


def _rs(name: str) -> dict[str, str]:
    return {"type": RS, "name": name}


def _agent(name: str) -> dict[str, str]:
    return {"type": AGENTS, "name": name}


def config(**top: Any) -> dict[str, Any]:
    return {
        "math": _server(RS, "math_with_judge", allowed_agents=["simple_agent"]),
        "code": _server(RS, "code_gen"),
        "lonely": _server(RS, "lonely_rs"),
        "solo": _server(RS, "solo_rs"),
        "pinned": _server(RS, "pinned_rs", datasets=[{"name": "p", "agent": "pinned_b"}]),
        "badpin": _server(RS, "badpin_rs", datasets=[{"name": "p", "agent": "math_simple_agent"}]),
        "conflict": _server(
            RS,
            "conflict_rs",
            datasets=[{"name": "c1", "agent": "pinned_a"}, {"name": "c2", "agent": "pinned_b"}],
        ),
        "policy": _server("responses_api_models", "openai_model"),
        "math_simple_agent": _server(AGENTS, "simple_agent", resources_server=_rs("math")),
        "math_hermes_agent": _server(AGENTS, "hermes_agent", resources_server=_rs("math")),
        "tool_agent": _server(AGENTS, "tool_agent", resources_server=_rs("code")),
        "code_agent": _server(
            AGENTS,
            "simple_agent",
            resources_server=_rs("code"),
            datasets=[{"name": "code_eval", "allowed_agents": ["hermes_agent"]}],
        ),
        "solo_agent": _server(AGENTS, "simple_agent", resources_server=_rs("solo")),
        "pinned_a": _server(AGENTS, "simple_agent", resources_server=_rs("pinned")),
        "pinned_b": _server(AGENTS, "simple_agent", resources_server=_rs("pinned")),
        "selfpin": _server(AGENTS, "simple_agent", datasets=[{"name": "s", "agent": "pinned_a"}]),
        "dual_agent": _server(AGENTS, "simple_agent"),
        "harbor_agent": _server(
            AGENTS,
            "terminus_agent",
            datasets=[{"name": "harbor", "taskset": "harbor:test", "allowed_agents": ["claude_code"]}],
        ),
        "env_math": _server(ENVS, "legacy_agent", agent_server=_agent("math_simple_agent")),
        "env_hermes": _server(ENVS, "legacy_agent", agent_server=_agent("math_hermes_agent")),
        "env_sim": _server(
            ENVS,
            "nemo_user_sim",
            user=_agent("pinned_a"),
            assistant=_agent("pinned_b"),
            resources_server=_rs("math"),
        ),
        "env_dual1": _server(ENVS, "legacy_agent", agent_server=_agent("dual_agent")),
        "env_dual2": _server(ENVS, "legacy_agent", agent_server=_agent("dual_agent")),
        "env_harbor": _server(ENVS, "single_agent_turn", agent_server=_agent("harbor_agent")),
        "policy_base_url": "http://127.0.0.1:9",
        "environment_server_routes": {"sim:val": "env_sim", "harbor:test": "env_harbor"},
        **top,
    }


TOPOLOGY = Topology.from_config(config())


def flat(text: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": text}, **extra}


def named(agent: str, **extra: Any) -> dict[str, Any]:
    return flat("q", agent_ref={"name": agent}, **extra)


def task_row(taskset: str, task_id: str, **extra: Any) -> dict[str, Any]:
    return {"task_id": {"taskset": taskset, "task_id": task_id}, "task_input": {}, **extra}


# --- resolve_task_sources -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "agent"),
    [
        pytest.param("tool_agent", "tool_agent", id="agent-is-itself"),
        pytest.param("solo", "solo_agent", id="only-agent-of-resources-server"),
        pytest.param("pinned", "pinned_b", id="dataset-pin-picks-among-agents"),
    ],
)
def test_resolve_task_sources_resolves(source: str, agent: str) -> None:
    rows = [flat("q", task_source=source)]
    before = copy.deepcopy(rows)
    assert resolve_task_sources(rows, TOPOLOGY) == [flat("q", task_source=source, agent_ref={"name": agent})]
    assert rows == before


def test_resolve_task_sources_leaves_named_materialized_and_stamped_rows_alone() -> None:
    rows = [
        named("tool_agent", task_source="math"),
        task_row("sim:val", "t1"),
        flat("q", task_source="math", _ng_environment_server="env_math"),
    ]
    out = resolve_task_sources(rows, TOPOLOGY)
    assert out == rows
    assert all(a is b for a, b in zip(out, rows, strict=True))


def test_resolve_task_sources_reports_every_failure_together() -> None:
    sources = [
        "maht",
        "policy_base_url",
        "conflict",
        "lonely",
        "math",
        "selfpin",
        "badpin",
        "env_math",
        "policy",
    ]
    rows = [flat(f"q{i}", task_source=s) for i, s in enumerate(sources)] + [flat("again", task_source="maht")]
    with pytest.raises(ValidationError) as info:
        resolve_task_sources(rows, TOPOLOGY)
    assert info.value.problems == [
        "'maht': not in the running config (did you mean 'math'?) [row 0, row 9]",
        "'policy_base_url': not a server instance (it is a plain config key) [row 1]",
        "'conflict': its datasets pin conflicting agents (['pinned_a', 'pinned_b']), which task_source alone "
        "cannot tell apart; pass agent_map={'conflict': <agent>} to pick one [row 2]",
        "'lonely': no agent in the running config references resources server 'lonely'; include an agent "
        "bound to it, or route the rows with agent_map [row 3]",
        "'math': 2 agents reference this resources server (['math_hermes_agent', 'math_simple_agent']); pin "
        "one with an 'agent:' key on the dataset, or pass agent_map={'math': <agent>} [row 4]",
        "'selfpin': a dataset declared by agent 'selfpin' pins agent 'pinned_a', but its rows are dispatched "
        "to the declaring agent; drop the pin or declare the dataset on 'pinned_a' [row 5]",
        "'badpin': its datasets pin agent 'math_simple_agent', but no agent of that name references "
        "resources server 'badpin'; agents referencing it: none [row 6]",
        "'env_math': instance is not an agent or resources server (it is environment_servers); datasets "
        "cannot route there [row 7]",
        "'policy': instance is not an agent or resources server (it is responses_api_models); datasets "
        "cannot route there [row 8]",
    ]
    assert str(info.value).startswith("Cannot resolve task_source to an agent:\n  - 'maht': not in")


# --- compatibility stamping -------------------------------------------------------------------------


def test_stamp_environment_agent_refs() -> None:
    rows = [
        flat("a", _ng_environment_server="env_math"),
        named("pinned_a", _ng_environment_server="env_sim"),
        flat("b", _ng_environment_server="env_sim"),
        task_row("harbor:test", "t1", _ng_environment_server="env_harbor"),
        flat("c", task_source="math"),
    ]
    before = copy.deepcopy(rows)
    out = stamp_environment_agent_refs(rows, TOPOLOGY)
    assert out == [
        flat("a", _ng_environment_server="env_math", agent_ref={"name": "math_simple_agent"}),
        *before[1:],
    ]
    assert rows == before
    assert all(a is b for a, b in zip(out[1:], rows[1:], strict=True))


# --- validate_rows ------------------------------------------------------------------------------------


def test_valid_rows_pass_untouched_and_one_bad_row_among_them_is_named() -> None:
    rows = [
        named("math_simple_agent", task_source="math", _ng_task_index=0, _ng_rollout_index=0),
        named("solo_agent"),
        task_row("sim:val", "t1", _ng_environment_server="env_sim"),
        task_row("sim:val", "t2"),
        flat("q", _ng_environment_server="env_math"),
        named("pinned_b", _ng_environment_server="env_sim"),
    ]
    before = copy.deepcopy(rows)
    assert validate_rows(rows, TOPOLOGY) is None
    assert rows == before  # validation never stamps or mutates a row
    # the same rows with one unknown agent appended: that row, and only it, is reported
    with pytest.raises(ValidationError) as caught:
        validate_rows([*rows, named("solo_agnet")], TOPOLOGY)
    assert caught.value.problems is not None
    assert len(caught.value.problems) == 1
    assert "row 6" in caught.value.problems[0]
    assert "'solo_agnet'" in caught.value.problems[0]


def test_routing_problems_list_every_row() -> None:
    rows = [
        named("math_simple_agent", _ng_environment_server="env_maht", _ng_task_index=0, _ng_rollout_index=0),
        named("math_hermes_agent", _ng_environment_server="env_math", _ng_task_index=1, _ng_rollout_index=0),
        flat("q", _ng_environment_server="env_maht", _ng_task_index=2, _ng_rollout_index=3),
        task_row("nope:x", "t9"),
        named("ghost"),  # a name problem: reported only after the routing problems are fixed
    ]
    with pytest.raises(RoutingError) as info:
        validate_rows(rows, TOPOLOGY)
    assert str(info.value) == (
        "Rows cannot be routed to their environment server:\n"
        "  - environment server 'env_maht' is not in the running config (did you mean 'env_math'?); "
        "environment servers: env_dual1, env_dual2, env_harbor, env_hermes, env_math, env_sim "
        "[row 0 (task 0, rollout 0), row 2 (task 2, rollout 3)]\n"
        "  - agent 'math_hermes_agent' is not fronted by its environment server 'env_math', which fronts: "
        "math_simple_agent [row 1 (task 1, rollout 0)]\n"
        "  - taskset 'nope:x' has no environment_server_routes entry [row 3 (task_id nope:x/t9)]\n"
        "Fix the stamps or environment_server_routes in the config, or re-preprocess the rows."
    )


def test_unknown_agents_and_agentless_rows_are_validation_errors() -> None:
    rows = [
        named("math_simple_agnet"),
        named("math"),
        named("ghost"),
        flat("q", task_source="math"),
        named("math_simple_agnet", _ng_task_index=4, _ng_rollout_index=1),
    ]
    with pytest.raises(ValidationError) as info:
        validate_rows(rows, TOPOLOGY)
    assert info.value.problems == [
        "unknown agent: 'math_simple_agnet' is not in the running config (did you mean 'math_simple_agent'?) "
        "[row 0, row 4 (task 4, rollout 1)]",
        "unknown agent: 'math' exists but is not an agent (it is a resources_servers instance) [row 1]",
        "unknown agent: 'ghost' is not in the running config [row 2]",
        "unknown agent: the row has no agent_ref and no environment server stamp; resolve its task_source or "
        "preprocess it with agent_map [row 3]",
    ]


def test_allowed_agents_from_each_of_the_three_places() -> None:
    rows = [
        named("tool_agent", task_source="math"),  # the task_source verifier rejects tool_agent
        named("math_hermes_agent"),  # the agent's own resources server rejects hermes_agent
        named("code_agent"),  # the dataset entry its agent declares admits only hermes_agent
        task_row("harbor:test", "t1", _ng_environment_server="env_harbor"),  # entry met by taskset
        task_row("harbor:test", "t2"),  # unstamped: routed by taskset, same entry
    ]
    with pytest.raises(ValidationError) as info:
        validate_rows(rows, TOPOLOGY)
    assert info.value.problems == [
        "unsupported pairing: rows run agent 'tool_agent' (type 'tool_agent'), but their task_source 'math' "
        "accepts only: simple_agent [row 0]",
        "unsupported pairing: rows run agent 'math_hermes_agent' (type 'hermes_agent'), but the resources "
        "server 'math' the agent runs against accepts only: simple_agent [row 1]",
        "unsupported pairing: rows run agent 'code_agent' (type 'simple_agent'), but dataset entry "
        "'code_eval' declared by 'code_agent' accepts only: hermes_agent [row 2]",
        "unsupported pairing: rows run agent 'harbor_agent' (type 'terminus_agent'), but dataset entry "
        "'harbor' declared by 'harbor_agent' accepts only: claude_code "
        "[row 3 (task_id harbor:test/t1), row 4 (task_id harbor:test/t2)]",
    ]
    validate_rows(rows, Topology.from_config(config(allow_unsupported_pairing=True)))


def test_agent_without_unique_front_is_a_routing_error() -> None:
    rows = [named("dual_agent", _ng_task_index=0, _ng_rollout_index=0), named("dual_agent")]
    with pytest.raises(RoutingError) as info:
        validate_rows(rows, TOPOLOGY)
    assert str(info.value).startswith(
        "Rows cannot be routed: their agent has no unique environment server:\n"
        "  - agent 'dual_agent' is fronted by several environment servers: env_dual1, env_dual2"
    )
    assert "[row 0 (task 0, rollout 0), row 1]\n" in str(info.value)
    validate_rows([named("dual_agent", _ng_environment_server="env_dual2")], TOPOLOGY)


def test_error_lists_are_bounded() -> None:
    rows = [named("ghost", _ng_task_index=i, _ng_rollout_index=0) for i in range(MAX_LISTED_ROWS + 5)]
    with pytest.raises(ValidationError) as info:
        validate_rows(iter(rows), TOPOLOGY)
    (problem,) = info.value.problems
    assert problem.endswith(f"row {MAX_LISTED_ROWS - 1} (task {MAX_LISTED_ROWS - 1}, rollout 0) and 5 more]")
    assert problem.count("row ") == MAX_LISTED_ROWS

"""Validation's quieter promises: what passes untouched, rows that are mappings but not dicts, and the
rows an error names. Expected values are written by hand from PROTOCOL.md section 4 and the config."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.errors import ValidationError
from gym_ray.plan.validation import resolve_task_sources, stamp_environment_agent_refs, validate_rows
from tests.plan.test_preprocess_validation import (
    AGENTS,
    RS,
    TOPOLOGY,
    _rs,
    _server,
    config,
    flat,
    named,
    task_row,
)


@pytest.mark.parametrize("function", [resolve_task_sources, stamp_environment_agent_refs])
def test_rows_passed_through_are_plain_dicts_even_when_given_as_other_mappings(function: Any) -> None:
    rows = [
        MappingProxyType(named("solo_agent")),
        MappingProxyType(flat("q", _ng_environment_server="env_nope")),
    ]
    out = function(rows, TOPOLOGY)
    assert [type(r) for r in out] == [dict, dict]
    assert out == [named("solo_agent"), flat("q", _ng_environment_server="env_nope")]


def test_a_row_stamped_for_an_unknown_server_is_not_stamped_with_an_agent() -> None:
    # validate_rows reports the unknown server; stamping leaves the row as it is
    rows = [flat("q", _ng_environment_server="env_nope")]
    assert stamp_environment_agent_refs(rows, TOPOLOGY) == [flat("q", _ng_environment_server="env_nope")]


def test_an_unresolved_task_source_names_the_row_by_position_and_identity() -> None:
    rows = [named("solo_agent"), flat("q", task_source="maht", _ng_task_index=4, _ng_rollout_index=1)]
    with pytest.raises(ValidationError) as caught:
        resolve_task_sources(rows, TOPOLOGY)
    assert str(caught.value) == (
        "Cannot resolve task_source to an agent:\n"
        "  - 'maht': not in the running config (did you mean 'math'?) [row 1 (task 4, rollout 1)]\n"
        "agent_map ({task_source: agent}) picks the agent for a task_source."
    )


@pytest.mark.parametrize(
    "row",
    [
        # a task_source that is no instance plays no part once the row names its agent
        pytest.param(named("solo_agent", task_source="nope"), id="task-source-not-an-instance"),
        # a flat row (no task_input) is routed by its agent, whatever its task_id says
        pytest.param(
            named("solo_agent", task_id={"taskset": "nope:x", "task_id": "t"}), id="flat-with-task-id"
        ),
    ],
)
def test_rows_that_name_a_valid_agent_pass(row: dict[str, Any]) -> None:
    assert validate_rows([row], TOPOLOGY) is None


def test_a_routed_taskset_without_dataset_entries_has_no_pairing_check() -> None:
    routes = {"sim:val": "env_sim", "harbor:test": "env_harbor", "plain:x": "env_math"}
    topology = Topology.from_config(config(environment_server_routes=routes))
    assert validate_rows([task_row("plain:x", "t1")], topology) is None


def test_a_pairing_error_lists_every_accepted_agent_type() -> None:
    duo = _server(RS, "duo_rs", allowed_agents=["hermes_agent", "simple_agent"])
    topology = Topology.from_config(
        config(duo=duo, duo_tool=_server(AGENTS, "tool_agent", resources_server=_rs("duo")))
    )
    with pytest.raises(ValidationError) as caught:
        validate_rows([named("duo_tool")], topology)
    assert caught.value.problems == [
        "unsupported pairing: rows run agent 'duo_tool' (type 'tool_agent'), but the resources server 'duo' "
        "the agent runs against accepts only: hermes_agent, simple_agent [row 0]"
    ]

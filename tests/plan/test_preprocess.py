"""preprocess: load_jsonl, and preprocess_examples / iter_preprocess (routing, agent_map, fan_out,
num_repeats, seeds, task_ids, dedupe). Resolution, stamping and validation: test_preprocess_validation.py."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_ray.errors import ConfigError, InputError, RoutingError, ValidationError
from gym_ray.plan.load import load_jsonl
from gym_ray.plan.preprocess import iter_preprocess, preprocess_examples


def flat(text: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": text}, **extra}


def ref(name: str) -> dict[str, str]:
    return {"name": name}


def ids(rows: list[dict[str, Any]]) -> list[tuple[int, int, str | None]]:
    return [
        (r["_ng_task_index"], r["_ng_rollout_index"], (r.get("agent_ref") or {}).get("name")) for r in rows
    ]


def _server(server_type: str, impl: str, **fields: Any) -> dict[str, Any]:
    return {server_type: {impl: {"host": "127.0.0.1", "port": 0, **fields}}}


def _agent_ref(name: str) -> dict[str, str]:
    return {"type": "responses_api_agents", "name": name}


def routed_config(**top: Any) -> dict[str, Any]:
    """Two agents (one fronted by env_a), a user-simulator env without an attributed agent, routes."""
    rs = {"type": "resources_servers", "name": "rs"}
    return {
        "rs": _server("resources_servers", "example_resources"),
        "agent_a": _server("responses_api_agents", "simple_agent", resources_server=rs),
        "agent_b": _server("responses_api_agents", "simple_agent", resources_server=rs),
        "env_a": _server("environment_servers", "legacy_agent", agent_server=_agent_ref("agent_a")),
        "env_sim": _server(
            "environment_servers",
            "nemo_user_sim",
            user=_agent_ref("agent_a"),
            assistant=_agent_ref("agent_b"),
        ),
        "environment_server_routes": {"sim:val": "env_sim", "a:test": "env_a"},
        **top,
    }


def task_row(taskset: str, task_id: str, **task_input: Any) -> dict[str, Any]:
    return {"task_id": {"taskset": taskset, "task_id": task_id}, "task_input": task_input}


# --- load_jsonl -----------------------------------------------------------------------------------


def test_load_jsonl_streams_flat_and_materialized_rows(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps(flat("q1", agent_ref=ref("a"))), json.dumps(task_row("sim:val", "t7", persona="x"))]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\r\n")
    rows = load_jsonl(path)
    assert isinstance(rows, Iterator)
    assert list(rows) == [flat("q1", agent_ref=ref("a")), task_row("sim:val", "t7", persona="x")]


@pytest.mark.parametrize(
    ("content", "line", "what"),
    [
        pytest.param(
            b'{"responses_create_params": {"input": "q"}}\n{"a": \n', 2, "malformed JSON", id="malformed"
        ),
        pytest.param(b'{"responses_create_params": {"input": "q"}}\n\n', 2, "blank line", id="blank"),
        pytest.param(b"  \n", 1, "blank line", id="whitespace-only"),
        pytest.param(b"[1, 2]\n", 1, "is a JSON list, not an object", id="list"),
        pytest.param(b'"text"\n', 1, "is a JSON str, not an object", id="string"),
        pytest.param(
            b'{"responses_create_params": {"input": "q"}}\n{"x": "\xff"}\n',
            2,
            "not valid UTF-8 (byte 0xff",
            id="utf8",
        ),
        pytest.param(b'{"input": "q"}\n', 1, "has no 'responses_create_params'", id="no-rcp"),
        pytest.param(b'{"responses_create_params": "q"}\n', 1, "not an object", id="rcp-not-object"),
        pytest.param(
            b'{"task_id": {"taskset": "", "task_id": "t"}, "task_input": {}}\n',
            1,
            "task_id.taskset is missing",
            id="materialized-no-taskset",
        ),
        pytest.param(
            b'{"task_id": {"taskset": "s", "task_id": 3}, "task_input": {}}\n',
            1,
            "task_id.task_id is missing or not a string",
            id="materialized-int-task-id",
        ),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, content: bytes, line: int, what: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError) as info:
        list(load_jsonl(path))
    assert str(info.value).startswith(f"{path}, line {line}: ")
    assert what in str(info.value)
    assert (info.value.path, info.value.line) == (str(path), line)


def test_load_jsonl_oversized_line(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    row = json.dumps(flat("x" * 100))
    path.write_text(f"{row}\n{row}\n")
    assert len(list(load_jsonl(path, max_line_bytes=len(row)))) == 2
    with pytest.raises(InputError, match=r"line 1: line is longer than max_line_bytes=50") as info:
        list(load_jsonl(path, max_line_bytes=50))
    assert info.value.line == 1


def test_load_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"cannot open input file '.*nope.jsonl'"):
        list(load_jsonl(tmp_path / "nope.jsonl"))


def test_load_jsonl_raises_before_yielding_a_later_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(flat("q")) + "\nnot json\n")
    rows = load_jsonl(path)
    assert next(rows) == flat("q")
    with pytest.raises(InputError, match="line 2: malformed JSON"):
        next(rows)


# --- num_repeats --------------------------------------------------------------------------------


def test_int_num_repeats_exact_rows() -> None:
    rows = [flat("q1", agent_ref=ref("a")), flat("q2", task_source="ts")]
    assert preprocess_examples(rows, num_repeats=2) == [
        {**flat("q1", agent_ref=ref("a")), "_ng_task_index": 0, "_ng_rollout_index": 0},
        {**flat("q1", agent_ref=ref("a")), "_ng_task_index": 0, "_ng_rollout_index": 1},
        {**flat("q2", task_source="ts"), "_ng_task_index": 1, "_ng_rollout_index": 0},
        {**flat("q2", task_source="ts"), "_ng_task_index": 1, "_ng_rollout_index": 1},
    ]


def test_dict_num_repeats_by_target_routing_key_and_default() -> None:
    rows = [flat("q1", agent_ref=ref("a")), flat("q2", agent_ref=ref("b")), flat("q3", task_source="ts")]
    out = preprocess_examples(rows, num_repeats={"a": 3, "ts": 2, "_default": 1})
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (2, 0),
        (2, 1),
    ]


def test_dict_num_repeats_mapped_target_wins_over_routing_key() -> None:
    rows = [flat("q1", task_source="ts")]
    out = preprocess_examples(rows, agent_map={"ts": "a"}, num_repeats={"ts": 1, "a": 2})
    assert ids(out) == [(0, 0, "a"), (0, 1, "a")]


def test_dict_num_repeats_without_default_names_the_missing_keys() -> None:
    rows = [flat("q1", agent_ref=ref("a")), flat("q2", agent_ref=ref("b")), flat("q3", agent_ref=ref("b"))]
    with pytest.raises(ConfigError) as info:
        preprocess_examples(rows, num_repeats={"a": 2})
    assert info.value.key == "num_repeats"
    assert str(info.value) == (
        "num_repeats has no entry for these rows and no '_default' fallback:\n"
        "  - routing keys 'b' [row 1 (task 1), row 2 (task 2)]\n"
        "Listed keys: ['a']. Add the keys or a '_default' entry."
    )


@pytest.mark.parametrize(
    ("num_repeats", "key", "text"),
    [
        pytest.param(0, "num_repeats", "num_repeats must be an integer >= 1, got 0", id="zero"),
        pytest.param(True, "num_repeats", "got True", id="bool"),
        pytest.param(1.5, "num_repeats", "got 1.5", id="float"),
        pytest.param(
            {"a": 0}, "num_repeats.a", "num_repeats.a must be an integer >= 1, got 0", id="dict-zero"
        ),
    ],
)
def test_bad_num_repeats(num_repeats: Any, key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        preprocess_examples([flat("q", agent_ref=ref("a"))], num_repeats=num_repeats)
    assert info.value.key == key


def test_unused_num_repeats_key_warns() -> None:
    with pytest.warns(
        UserWarning, match=r"num_repeats keys never matched an input row \(possible typo\?\): \['b'\]"
    ):
        out = preprocess_examples([flat("q", agent_ref=ref("a"))], num_repeats={"a": 1, "b": 2})
    assert ids(out) == [(0, 0, "a")]


# --- agent_map and fan_out ------------------------------------------------------------------------


def test_agent_map_by_agent_by_task_source_and_default() -> None:
    rows = [flat("q1", agent_ref=ref("old")), flat("q2", task_source="ts"), flat("q3")]
    with pytest.warns(UserWarning, match=r"agent_map overrode agent_ref values .*: \[\('old', 'new'\)\]"):
        out = preprocess_examples(rows, agent_map={"old": "new", "ts": "from_ts", "_default": "dflt"})
    assert out == [
        {**flat("q1"), "agent_ref": ref("new"), "_ng_task_index": 0, "_ng_rollout_index": 0},
        {
            **flat("q2", task_source="ts"),
            "agent_ref": ref("from_ts"),
            "_ng_task_index": 1,
            "_ng_rollout_index": 0,
        },
        {**flat("q3"), "agent_ref": ref("dflt"), "_ng_task_index": 2, "_ng_rollout_index": 0},
    ]


def test_agent_map_agent_key_beats_task_source_key_and_rewrites_a_same_name_ref_as_0_7() -> None:
    # 0.7 writes {"name": mapped} for every mapped row, also one that named the agent with more fields;
    # a row no entry maps keeps its agent_ref as it is.
    rows = [
        flat("q1", agent_ref=ref("a"), task_source="ts"),
        flat("q2", agent_ref={"name": "b", "type": "responses_api_agents"}),
        flat("q3", agent_ref={"name": "c", "type": "responses_api_agents"}),
    ]
    out = preprocess_examples(rows, agent_map={"a": "a", "ts": "x", "b": "b"})
    typed = {"name": "c", "type": "responses_api_agents"}
    assert [r["agent_ref"] for r in out] == [ref("a"), ref("b"), typed]


def test_agent_map_without_default_leaves_unmatched_rows() -> None:
    out = preprocess_examples([flat("q", agent_ref=ref("a"))], agent_map={"z": "y"})
    assert ids(out) == [(0, 0, "a")]


def test_fan_out_wins_over_agent_map_and_counts_rollouts_across_targets() -> None:
    rows = [
        flat("q1", task_source="math"),
        flat("q2", agent_ref=ref("other")),
        flat("q1", task_source="math"),
    ]
    out = preprocess_examples(
        rows,
        agent_map={"math": "ignored"},
        fan_out={"math": ["simple", "hermes"]},
        num_repeats={"math": 2, "_default": 1},
    )
    assert ids(out) == [
        (0, 0, "simple"),
        (0, 1, "simple"),
        (0, 2, "hermes"),
        (0, 3, "hermes"),
        (1, 0, "other"),
        (0, 4, "simple"),
        (0, 5, "simple"),
        (0, 6, "hermes"),
        (0, 7, "hermes"),
    ]


@pytest.mark.parametrize(
    ("fan_out", "text"),
    [
        pytest.param({"k": []}, "fan_out.k is an empty list", id="empty"),
        pytest.param(
            {"k": ["a", "b", "a"]},
            r"fan_out.k lists the same agent more than once: \['a', 'b', 'a'\]",
            id="dup",
        ),
        pytest.param({"k": "a"}, "fan_out.k must be a list of agent names, got 'a'", id="string"),
        pytest.param({"k": ["a", ""]}, "fan_out.k must list agent names", id="empty-name"),
    ],
)
def test_bad_fan_out(fan_out: Any, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        preprocess_examples([flat("q", agent_ref=ref("a"))], fan_out=fan_out)
    assert info.value.key == "fan_out.k"


def test_rows_without_agent_are_listed_together() -> None:
    rows = [flat("q0", agent_ref=ref("a")), flat("q1"), {"input": "q2"}, flat("q3")]
    with pytest.raises(InputError) as info:
        preprocess_examples(rows)
    assert str(info.value) == (
        "Input rows cannot be preprocessed:\n"
        "  - the row names no agent: give it agent_ref or task_source, or pass agent_map with a '_default' "
        "entry [row 1, row 3]\n"
        "  - the row has no 'responses_create_params' (a flat row needs it; a materialized task row needs "
        "'task_id' and 'task_input' instead) [row 2]\n"
        "Fix these rows and run again."
    )


# --- overrides, seeds, task indices, selection, order ----------------------------------------------


def test_responses_create_params_overrides_merge_shallow_and_input_is_untouched() -> None:
    rows = [{"responses_create_params": {"input": "q", "temperature": 1.0}, "agent_ref": ref("a")}]
    before = copy.deepcopy(rows)
    out = preprocess_examples(rows, responses_create_params={"temperature": 0.5, "max_output_tokens": 9})
    assert out[0]["responses_create_params"] == {"input": "q", "temperature": 0.5, "max_output_tokens": 9}
    assert rows == before


def test_seeds_are_rollout_indices_in_extra_body_json_string() -> None:
    rows = [
        {
            "responses_create_params": {"input": "q", "metadata": {"extra_body": '{"top_k": 5}', "k": "v"}},
            "agent_ref": ref("a"),
        },
        {
            "responses_create_params": {"input": "r", "metadata": {"extra_body": {"top_p": 1}}},
            "agent_ref": ref("a"),
        },
        flat("s", agent_ref=ref("a")),
    ]
    out = preprocess_examples(rows, num_repeats=2, num_repeats_add_seed=True)
    assert [r["responses_create_params"]["metadata"] for r in out] == [
        {"extra_body": '{"top_k": 5, "seed": 0}', "k": "v"},
        {"extra_body": '{"top_k": 5, "seed": 1}', "k": "v"},
        {"extra_body": '{"top_p": 1, "seed": 0}'},
        {"extra_body": '{"top_p": 1, "seed": 1}'},
        {"extra_body": '{"seed": 0}'},
        {"extra_body": '{"seed": 1}'},
    ]
    assert rows[0]["responses_create_params"]["metadata"]["extra_body"] == '{"top_k": 5}'


def test_seed_with_bad_extra_body_names_the_row() -> None:
    rows = [
        {"responses_create_params": {"input": "q", "metadata": {"extra_body": "[1]"}}, "agent_ref": ref("a")}
    ]
    with pytest.raises(InputError, match=r"extra_body that is not a JSON object string \[row 0 \(task 0\)\]"):
        preprocess_examples(rows, num_repeats_add_seed=True)


def test_identical_rows_share_a_task_index_by_canonical_json() -> None:
    rows = [
        {"agent_ref": ref("a"), "responses_create_params": {"input": "q", "temperature": 1}},
        flat("other", agent_ref=ref("a")),
        {"responses_create_params": {"temperature": 1, "input": "q"}, "agent_ref": ref("a")},
    ]
    assert ids(preprocess_examples(rows, num_repeats=2)) == [
        (0, 0, "a"),
        (0, 1, "a"),
        (1, 0, "a"),
        (1, 1, "a"),
        (0, 2, "a"),
        (0, 3, "a"),
    ]


def test_caller_task_indices_are_kept_and_interleave_orders_by_rollout() -> None:
    rows = [flat("q0", agent_ref=ref("a")), flat("q1", agent_ref=ref("a"), _ng_task_index=7)]
    assert ids(preprocess_examples(rows, num_repeats=2, interleave_repeats=True)) == [
        (0, 0, "a"),
        (7, 0, "a"),
        (0, 1, "a"),
        (7, 1, "a"),
    ]


@pytest.mark.parametrize(
    "bad", [pytest.param(-1, id="negative"), pytest.param("3", id="string"), pytest.param(True, id="bool")]
)
def test_bad_caller_task_index(bad: Any) -> None:
    with pytest.raises(InputError, match=r"_ng_task_index must be an integer >= 0 \[row 0 \(task"):
        preprocess_examples([flat("q", agent_ref=ref("a"), _ng_task_index=bad)])


def test_task_ids_select_each_task_once_before_repetition() -> None:
    rows = [
        flat("q0", agent_ref=ref("a")),
        flat("q1", agent_ref=ref("a")),
        flat("q2", agent_ref=ref("a")),
        flat("q0", agent_ref=ref("a")),
    ]
    out = preprocess_examples(rows, num_repeats=2, task_ids=[0, "2"])
    assert ids(out) == [(0, 0, "a"), (0, 1, "a"), (2, 0, "a"), (2, 1, "a")]


def test_task_ids_unknown_id_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"task_ids names tasks the input does not contain: \['5', 'x'\]"
    ) as info:
        preprocess_examples([flat("q", agent_ref=ref("a"))], task_ids=["x", 5, 0])
    assert info.value.key == "task_ids"


def test_task_ids_select_materialized_rows_by_task_id() -> None:
    rows = [task_row("sim:val", "t1"), task_row("sim:val", "t2"), task_row("a:test", "t1")]
    out = preprocess_examples(rows, task_ids=["t1"], global_config_dict=routed_config())
    assert [(r["task_id"], r["_ng_task_index"], r["_ng_rollout_index"]) for r in out] == [
        ({"taskset": "sim:val", "task_id": "t1"}, 0, 0),
        ({"taskset": "a:test", "task_id": "t1"}, 2, 0),
    ]


def test_iter_preprocess_checks_knobs_at_the_call() -> None:
    with pytest.raises(ConfigError, match="num_repeats must be an integer >= 1, got 0"):
        iter_preprocess([], num_repeats=0)


def test_iter_preprocess_streams_its_input() -> None:
    pulled: list[int] = []

    def rows() -> Iterator[dict[str, Any]]:
        for i in range(1000):
            pulled.append(i)
            yield flat(f"q{i}", agent_ref=ref("a"))

    out = iter_preprocess(rows(), num_repeats=2)
    assert [next(out)["_ng_rollout_index"], next(out)["_ng_rollout_index"]] == [0, 1]
    assert pulled == [0]


# --- routing ---------------------------------------------------------------------------------------


def test_materialized_rows_route_by_taskset_and_carry_no_agent() -> None:
    rows = [task_row("sim:val", "t7", persona="x"), flat("q", task_source="rs")]
    out = preprocess_examples(
        rows, num_repeats=2, global_config_dict=routed_config(), agent_map={"rs": "agent_b"}
    )
    assert out == [
        {
            **task_row("sim:val", "t7", persona="x"),
            "_ng_task_index": 0,
            "_ng_environment_server": "env_sim",
            "_ng_rollout_index": 0,
        },
        {
            **task_row("sim:val", "t7", persona="x"),
            "_ng_task_index": 0,
            "_ng_environment_server": "env_sim",
            "_ng_rollout_index": 1,
        },
        {
            **flat("q", task_source="rs"),
            "agent_ref": ref("agent_b"),
            "_ng_task_index": 1,
            "_ng_rollout_index": 0,
        },
        {
            **flat("q", task_source="rs"),
            "agent_ref": ref("agent_b"),
            "_ng_task_index": 1,
            "_ng_rollout_index": 1,
        },
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        pytest.param(
            {},
            RoutingError,
            "row 0 is a materialized task row of taskset 'sim:val', which routes by "
            "environment_server_routes; pass global_config_dict= or topology=",
            id="no-topology",
        ),
        pytest.param(
            {"global_config_dict": routed_config(environment_server_routes={"a:test": "env_a"})},
            RoutingError,
            "row 0 .*No environment server route is configured for taskset 'sim:val'",
            id="no-route",
        ),
        pytest.param(
            {"global_config_dict": routed_config(), "responses_create_params": {"temperature": 0}},
            ConfigError,
            "responses_create_params is not supported for materialized task rows",
            id="rcp",
        ),
        pytest.param(
            {"global_config_dict": routed_config(), "num_repeats_add_seed": True},
            ConfigError,
            "num_repeats_add_seed is not supported for materialized task rows",
            id="seed",
        ),
    ],
)
def test_materialized_row_errors(kwargs: dict[str, Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        preprocess_examples([task_row("sim:val", "t7")], **kwargs)


def test_legacy_mode_stamps_every_flat_row_and_its_attributed_agent() -> None:
    cfg = routed_config(environment_routing_mode="legacy", environment_server_name="env_a")
    rows = [flat("q", task_source="rs"), flat("r", agent_ref=ref("agent_b"))]
    out = preprocess_examples(rows, global_config_dict=cfg, agent_map={"rs": "agent_b"})
    assert out == [
        {
            **flat("q", task_source="rs"),
            "_ng_task_index": 0,
            "_ng_environment_server": "env_a",
            "agent_ref": ref("agent_a"),
            "_ng_rollout_index": 0,
        },
        {
            **flat("r", agent_ref=ref("agent_b")),
            "_ng_task_index": 1,
            "_ng_environment_server": "env_a",
            "_ng_rollout_index": 0,
        },
    ]


def test_taskset_mode_refuses_flat_rows() -> None:
    cfg = routed_config(environment_routing_mode="taskset")
    with pytest.raises(RoutingError, match="row 0 is a flat row, but environment_routing_mode=taskset"):
        preprocess_examples([flat("q", agent_ref=ref("agent_a"))], global_config_dict=cfg)


def test_task_source_rows_resolve_with_a_config_and_failures_come_together() -> None:
    cfg = routed_config()
    assert ids(preprocess_examples([flat("q", task_source="agent_b")], global_config_dict=cfg)) == [
        (0, 0, "agent_b")
    ]
    with pytest.raises(ValidationError) as info:
        preprocess_examples(
            [flat("q", task_source="rs"), flat("r", task_source="env_sim")], global_config_dict=cfg
        )
    assert info.value.problems == [
        "'rs': 2 agents reference this resources server (['agent_a', 'agent_b']); pin one with an "
        "'agent:' key on the dataset, or pass agent_map={'rs': <agent>} [row 0 (task 0)]",
        "'env_sim': instance is not an agent or resources server (it is environment_servers); datasets "
        "cannot route there [row 1 (task 1)]",
    ]


def test_global_config_and_topology_are_exclusive() -> None:
    from gym_ray.config.topology import Topology

    cfg = routed_config()
    with pytest.raises(ConfigError, match="pass global_config_dict or topology, not both"):
        preprocess_examples([], global_config_dict=cfg, topology=Topology.from_config(cfg))


# --- properties ------------------------------------------------------------------------------------

_texts = st.sampled_from(["q0", "q1", "q2"])
_row = st.one_of(
    st.builds(lambda t, a: flat(t, agent_ref=ref(a)), _texts, st.sampled_from(["a", "b"])),
    st.builds(lambda t, s: flat(t, task_source=s), _texts, st.sampled_from(["ts", "math"])),
    st.builds(lambda t, i: flat(t, agent_ref=ref("a"), _ng_task_index=i), _texts, st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(_row, max_size=12),
    num_repeats=st.one_of(
        st.integers(1, 3),
        st.fixed_dictionaries({"_default": st.integers(1, 3)}, optional={"a": st.integers(1, 3)}),
    ),
    fan_out=st.sampled_from([None, {"math": ["a", "b"]}, {"a": ["b", "c"]}]),
    agent_map=st.sampled_from([None, {"ts": "c"}, {"a": "b", "_default": "c"}]),
    interleave=st.booleans(),
    seed=st.booleans(),
)
def test_rollout_identities_are_unique_and_inputs_unmutated(
    rows: list[dict[str, Any]], num_repeats: Any, fan_out: Any, agent_map: Any, interleave: bool, seed: bool
) -> None:
    before = copy.deepcopy(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # unused keys, agent_map overrides
        out = preprocess_examples(
            rows,
            num_repeats=num_repeats,
            fan_out=fan_out,
            agent_map=agent_map,
            interleave_repeats=interleave,
            num_repeats_add_seed=seed,
        )
    assert rows == before
    identities = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in out]
    assert len(identities) == len(set(identities))
    for task in {t for t, _ in identities}:
        assert sorted(r for t, r in identities if t == task) == list(
            range(sum(t == task for t, _ in identities))
        )
    for row in out:
        row["responses_create_params"]["input"] = "changed"
        row.setdefault("agent_ref", {})["name"] = "changed"
    assert rows == before

"""Config loading (YAML files + overrides via OmegaConf) and the pydantic run settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pydantic
import pytest

from gym_ray.config.settings import RunSettings, load_config
from gym_ray.errors import ConfigError


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


BASE = """\
head_server: {host: 127.0.0.1, port: 11000}
num_repeats: 1
policy_model_name: stub-model
math:
  resources_servers:
    math_with_judge:
      host: 127.0.0.1
      port: 12001
      allowed_agents: [simple_agent]
      judge_model: ${policy_model_name}
"""

LOCAL = """\
num_repeats: 4
math:
  resources_servers:
    math_with_judge:
      port: 13001
      allowed_agents: [hermes_agent]
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return _write(tmp_path, "base.yaml", BASE)


# --- files and merging ----------------------------------------------------------------------------


def test_files_merge_in_order_and_return_plain_data(tmp_path: Path, base: Path) -> None:
    local = _write(tmp_path, "local.yaml", LOCAL)
    cfg = load_config([base, str(local)])
    assert cfg == {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "num_repeats": 4,
        "policy_model_name": "stub-model",
        "math": {
            "resources_servers": {
                "math_with_judge": {
                    "host": "127.0.0.1",
                    "port": 13001,
                    "allowed_agents": ["hermes_agent"],
                    "judge_model": "stub-model",
                }
            }
        },
    }
    assert type(cfg) is dict
    assert type(cfg["math"]["resources_servers"]["math_with_judge"]["allowed_agents"]) is list


def test_single_path_and_empty_file(tmp_path: Path, base: Path) -> None:
    empty = _write(tmp_path, "empty.yaml", "")
    assert load_config(empty) == {}  # type: ignore[arg-type]
    assert load_config([base, empty]) == load_config(str(base))  # type: ignore[arg-type]
    assert load_config([]) == {}


# --- overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        pytest.param("num_repeats=3", "num_repeats", 3, id="change-int"),
        pytest.param("policy_model_name=other", "policy_model_name", "other", id="change-string"),
        pytest.param("++num_repeats=7", "num_repeats", 7, id="force-change"),
        pytest.param("+seed=42", "seed", 42, id="add-int"),
        pytest.param("++seed=42", "seed", 42, id="force-add"),
        pytest.param("+request_timeout_s=1e3", "request_timeout_s", 1000.0, id="float"),
        pytest.param("+strict=true", "strict", True, id="bool"),
        pytest.param("+output_dir=null", "output_dir", None, id="null"),
        pytest.param("+output_dir=", "output_dir", None, id="empty-is-null"),
        pytest.param("+label='3'", "label", "3", id="quoted-string"),
        pytest.param("+task_ids=[3, 1, a]", "task_ids", [3, 1, "a"], id="list"),
        pytest.param(
            "+agent_map={math: math_simple_agent}", "agent_map", {"math": "math_simple_agent"}, id="map"
        ),
        pytest.param("+url=http://h:1/v1?a=b", "url", "http://h:1/v1?a=b", id="value-with-equals"),
        pytest.param(
            "+environment_server_routes.sim:val=sim",
            "environment_server_routes",
            {"sim:val": "sim"},
            id="colon-in-key",
        ),
    ],
)
def test_override_spellings(base: Path, override: str, key: str, expected: Any) -> None:
    assert load_config([base], [override])[key] == expected


def test_dotted_overrides_reach_nested_keys(base: Path) -> None:
    cfg = load_config(
        [base],
        [
            "math.resources_servers.math_with_judge.port=0",
            "math.resources_servers.math_with_judge.allowed_agents.0=hermes_agent",
            "+math.resources_servers.math_with_judge.datasets=[{name: d, type: train}]",
            "++head_server={port: 11001}",
        ],
    )
    inner = cfg["math"]["resources_servers"]["math_with_judge"]
    assert inner["port"] == 0
    assert inner["allowed_agents"] == ["hermes_agent"]
    assert inner["datasets"] == [{"name": "d", "type": "train"}]
    assert cfg["head_server"] == {"host": "127.0.0.1", "port": 11001}


def test_overrides_apply_in_order_after_every_file(tmp_path: Path, base: Path) -> None:
    local = _write(tmp_path, "local.yaml", LOCAL)
    assert load_config([base, local], ["num_repeats=2", "++num_repeats=5"])["num_repeats"] == 5


def test_single_override_string(base: Path) -> None:
    assert load_config([base], "num_repeats=9")["num_repeats"] == 9  # type: ignore[arg-type]


FORMS = "write key=value (change), +key=value (add) or ++key=value (add or change)"


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        pytest.param(
            "seed=1",
            "seed",
            "override 'seed=1' changes 'seed', which is not in the config; to add it write +seed=1 (or "
            "++seed=1 to add or change)",
            id="change-absent-key",
        ),
        pytest.param(
            "head_server.scheme=https",
            "head_server.scheme",
            "override 'head_server.scheme=https' changes 'head_server.scheme', which is not in the config; "
            "to add it write +head_server.scheme=https (or ++head_server.scheme=https to add or change)",
            id="change-absent-nested-key",
        ),
        pytest.param(
            "+num_repeats=2",
            "num_repeats",
            "override '+num_repeats=2' adds 'num_repeats', which is already in the config; to change it "
            "write num_repeats=2 (or ++num_repeats=2 to add or change)",
            id="add-present-key",
        ),
        pytest.param(
            "num_repeats",
            "num_repeats",
            f"override 'num_repeats' is malformed; {FORMS}, with a dotted key",
            id="no-equals",
        ),
        pytest.param("=3", None, f"override '=3' is malformed; {FORMS}, with a dotted key", id="empty-key"),
        pytest.param(
            "+=3", None, f"override '+=3' is malformed; {FORMS}, with a dotted key", id="empty-added-key"
        ),
        pytest.param(
            "a..b=3",
            "a..b",
            f"override 'a..b=3' is malformed; {FORMS}, with a dotted key",
            id="empty-segment",
        ),
        pytest.param(
            "a. b=3", "a. b", f"override 'a. b=3' is malformed; {FORMS}, with a dotted key", id="space-in-key"
        ),
        pytest.param(
            "+++seed=3", "+seed", f"override '+++seed=3' has an unknown prefix; {FORMS}", id="three-pluses"
        ),
        pytest.param(
            "~seed=3", "~seed", f"override '~seed=3' has an unknown prefix; {FORMS}", id="delete-prefix"
        ),
        pytest.param(
            "+task_ids=[1, 2",
            "task_ids",
            "override '+task_ids=[1, 2' has a value that does not parse (expected ']' at column 6, found "
            "the end); write e.g. +task_ids={a:1,b:2} or +task_ids=[x,y], quoting values that hold , ] or }",
            id="bad-yaml-value",
        ),
    ],
)
def test_malformed_override_is_refused(base: Path, override: str, key: str | None, message: str) -> None:
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        load_config([base], [override])
    assert info.value.key == key


# --- interpolation ---------------------------------------------------------------------------------


def test_interpolation_sees_overrides_and_environment(
    tmp_path: Path, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GYM_RAY_TEST_RUN_DIR", "/runs/7")
    extra = _write(
        tmp_path, "extra.yaml", "output_dir: ${oc.env:GYM_RAY_TEST_RUN_DIR}/out\nlabel: m-${num_repeats}\n"
    )
    cfg = load_config([base, extra], ["policy_model_name=big-model", "num_repeats=8"])
    assert cfg["math"]["resources_servers"]["math_with_judge"]["judge_model"] == "big-model"
    assert cfg["output_dir"] == "/runs/7/out"
    assert cfg["label"] == "m-8"


def test_interpolation_in_override_value(base: Path) -> None:
    assert load_config([base], ["+label=${policy_model_name}-x"])["label"] == "stub-model-x"


@pytest.mark.parametrize(
    ("text", "overrides", "key", "problem"),
    [
        pytest.param("a: ${nope}\n", [], "a", "Interpolation key 'nope' not found", id="unknown-key"),
        pytest.param(
            "a: 1\nb: [1, {c: '${nope.d}'}]\n",
            [],
            "b[1].c",
            "Interpolation key 'nope.d' not found",
            id="nested-in-list",
        ),
        pytest.param("a: 1\n", ["+b=${zz}"], "b", "Interpolation key 'zz' not found", id="from-override"),
        pytest.param(
            "a: ${oc.env:GYM_RAY_TEST_SURELY_UNSET}\n",
            [],
            "a",
            'KeyError raised while resolving interpolation: "Environment variable '
            "'GYM_RAY_TEST_SURELY_UNSET' not found\"",
            id="unset-environment-variable",
        ),
    ],
)
def test_unresolvable_interpolation_names_its_key(
    tmp_path: Path, text: str, overrides: list[str], key: str, problem: str
) -> None:
    path = _write(tmp_path, "c.yaml", text)
    message = (
        f"config key '{key}' has an interpolation that cannot be resolved: {problem}; define the key it "
        "refers to (or the environment variable), or fix the ${...} expression"
    )
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        load_config([path], overrides)
    assert info.value.key == key


# --- file errors ----------------------------------------------------------------------------------


def test_missing_file_and_directory(tmp_path: Path, base: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(
        ConfigError, match=_exact(f"config file '{missing}' does not exist; pass the path of a YAML file")
    ):
        load_config([base, missing])
    with pytest.raises(
        ConfigError, match=_exact(f"config file '{tmp_path}' is a directory; pass the path of a YAML file")
    ):
        load_config([tmp_path])


@pytest.mark.parametrize(
    ("text", "where"),
    [
        pytest.param(
            "a: 1\nb: [1, 2\nc: 3\n",
            "line 3, column 2: did not find expected ',' or ']' (while parsing a flow sequence at line 2)",
            id="unclosed-list",
        ),
        pytest.param(
            "a: 1\nb:\n  c: 1\n   d: 2\n",
            "line 4, column 5: mapping values are not allowed in this context",
            id="bad-indent",
        ),
        pytest.param(
            "a: 1\nb: 2\na: 3\n",
            "line 3, column 1: found duplicate key a (while constructing a mapping at line 1)",
            id="duplicate-key",
        ),
    ],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, text: str, where: str) -> None:
    path = _write(tmp_path, "broken.yaml", text)
    with pytest.raises(ConfigError, match=_exact(f"config file '{path}' {where}; fix the YAML there")):
        load_config([path])


def test_top_level_list_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "list.yaml", "- a\n- b\n")
    message = (
        f"config file '{path}' holds a ListConfig at the top level; a config file must be a mapping of keys "
        "(e.g. 'head_server: {host: 127.0.0.1, port: 11000}')"
    )
    with pytest.raises(ConfigError, match=_exact(message)):
        load_config([path])


def test_bad_interpolation_syntax_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "g.yaml", "a: 1\nb: ${oops\n")
    message = (
        f"config file '{path}' at key 'b': no viable alternative at input '${{oops'; fix the value there"
    )
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        load_config([path])
    assert info.value.key == "b"


def test_merge_conflict_names_file_and_key(tmp_path: Path, base: Path) -> None:
    other = _write(
        tmp_path,
        "other.yaml",
        "math:\n  resources_servers:\n    math_with_judge:\n      allowed_agents: {a: 1}\n",
    )
    key = "math.resources_servers.math_with_judge.allowed_agents"
    message = (
        f"config file '{other}' does not merge onto the files before it at '{key}': Cannot merge "
        "incompatible container types; make the value's kind (mapping, list, scalar) agree"
    )
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        load_config([base, other])
    assert info.value.key == key


# --- run settings ----------------------------------------------------------------------------------


def test_run_settings_defaults() -> None:
    settings = RunSettings.from_config({})
    assert settings.model_dump() == {
        "input_jsonl_fpath": None,
        "output_dir": None,
        "num_repeats": 1,
        "agent_map": None,
        "fan_out": None,
        "num_repeats_add_seed": False,
        "interleave_repeats": False,
        "task_ids": None,
        "responses_create_params": None,
        "max_resident_tasks": 256,
        "max_connections": 256,
        "request_timeout_s": 900.0,
        "connect_timeout_s": 10.0,
        "dispatch_budget_s": None,
        "drain_margin_s": None,
        "route_failures_to_sidecar": True,
        "retry_requests": True,
        "max_rollout_attempts": 3,
        "max_infra_retries": 10,
        "store_publish_every": 1000,
        "store_publish_interval_s": 30.0,
        "server_outage_timeout_s": 300.0,
        "shard_size": None,
        "num_workers": None,
        "strict": False,
        "no_progress_timeout_s": 600.0,
        "seed": None,
        "output_jsonl_fpath": None,
        "agent_name": None,
        "limit": None,
        "num_samples_in_parallel": None,
        "max_resident_rollout_tasks": None,
        "disable_aggregation": False,
        "require_complete": False,
        "resume_from_cache": None,
        "retain_results_in_memory": True,
        "upload_rollouts": True,
        "disable_health_check": None,
        "health_check_workers": None,
        "health_check_ignored_checks": (),
        "health_check": True,
        "max_failed_fraction": 0.0,
        "strict_json": True,
        "use_new_config": False,
        "control_actors_resource": None,
        "control_actor_restarts": 3,
    }


def test_run_settings_from_loaded_config(tmp_path: Path, base: Path) -> None:
    run = _write(
        tmp_path,
        "run.yaml",
        "input_jsonl_fpath: data/in.jsonl\noutput_dir: /tmp/out\nnum_repeats: {math: 4, _default: 1}\n"
        "agent_map: {math: math_simple_agent}\nfan_out: {code: [a1, a2]}\ntask_ids: [0, t7]\n"
        "responses_create_params: {temperature: 0.5}\nmax_resident_tasks: 32\ndispatch_budget_s: 60\n",
    )
    cfg = load_config([base, run], ["++strict=true", "+seed=7", "+max_rollout_attempts=5", "+shard_size=100"])
    settings = RunSettings.from_config(cfg)
    assert settings.input_jsonl_fpath == "data/in.jsonl"
    assert settings.output_dir == "/tmp/out"
    assert settings.num_repeats == {"math": 4, "_default": 1}
    assert settings.agent_map == {"math": "math_simple_agent"}
    assert settings.fan_out == {"code": ["a1", "a2"]}
    assert settings.task_ids == [0, "t7"]
    assert settings.responses_create_params == {"temperature": 0.5}
    assert (settings.max_resident_tasks, settings.max_connections) == (32, 32)
    assert settings.dispatch_budget_s == 60.0
    assert (settings.strict, settings.seed, settings.max_rollout_attempts, settings.shard_size) == (
        True,
        7,
        5,
        100,
    )


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        pytest.param({"max_resident_tasks": 16}, 16, id="follows-resident-tasks"),
        pytest.param(
            {"max_resident_tasks": 16, "max_connections": None}, 16, id="null-follows-resident-tasks"
        ),
        pytest.param({"max_resident_tasks": 16, "max_connections": 4}, 4, id="explicit"),
    ],
)
def test_max_connections_default(cfg: dict[str, Any], expected: int) -> None:
    assert RunSettings.from_config(cfg).max_connections == expected


def test_run_settings_are_frozen() -> None:
    settings = RunSettings.from_config({"max_resident_tasks": 4})
    with pytest.raises(pydantic.ValidationError):
        settings.max_resident_tasks = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cfg", "key", "message"),
    [
        pytest.param(
            {"max_resident_tasks": 0},
            "max_resident_tasks",
            "config key 'max_resident_tasks' is 0: Input should be greater than or equal to 1; "
            "allowed: int (>= 1)",
            id="resident-tasks-zero",
        ),
        pytest.param(
            {"request_timeout_s": "30"},
            "request_timeout_s",
            "config key 'request_timeout_s' is '30': Input should be a valid number; allowed: float (> 0)",
            id="timeout-a-string",
        ),
        pytest.param(
            {"dispatch_budget_s": -1},
            "dispatch_budget_s",
            "config key 'dispatch_budget_s' is -1: Input should be greater than 0; "
            "allowed: float | None (> 0)",
            id="negative-budget",
        ),
        pytest.param(
            {"max_rollout_attempts": True},
            "max_rollout_attempts",
            "config key 'max_rollout_attempts' is True: Input should be a valid integer; allowed: int (>= 1)",
            id="attempts-a-bool",
        ),
        pytest.param(
            {"num_repeats": 0},
            "num_repeats",
            "config key 'num_repeats' is 0: num_repeats must be an int >= 1, got 0; allowed: an int >= 1, or "
            "{routing key: int >= 1} with an optional _default",
            id="num-repeats-zero",
        ),
        pytest.param(
            {"num_repeats": {"math": 2, "code": 0}},
            "num_repeats",
            "config key 'num_repeats' is {'math': 2, 'code': 0}: every value of a num_repeats mapping must "
            "be an int >= 1, got {'code': 0}; allowed: an int >= 1, or {routing key: int >= 1} with an "
            "optional _default",
            id="num-repeats-mapping-zero",
        ),
        pytest.param(
            {"num_repeats": {}},
            "num_repeats",
            "config key 'num_repeats' is {}: a num_repeats mapping must not be empty; allowed: an int >= 1, "
            "or {routing key: int >= 1} with an optional _default",
            id="num-repeats-empty-mapping",
        ),
        pytest.param(
            {"fan_out": {"math": []}},
            "fan_out",
            "config key 'fan_out' is {'math': []}: fan_out['math'] is an empty list; list at least one agent "
            "or drop the key; allowed: {routing key: [distinct agent names]} or null",
            id="fan-out-empty",
        ),
        pytest.param(
            {"fan_out": {"math": ["a", "a"]}},
            "fan_out",
            "config key 'fan_out' is {'math': ['a', 'a']}: fan_out['math'] lists the same agent more than "
            "once: ['a', 'a']; allowed: {routing key: [distinct agent names]} or null",
            id="fan-out-duplicate",
        ),
        pytest.param(
            {"agent_map": {"math": 1}},
            "agent_map",
            "config key 'agent_map' is {'math': 1}: Input should be a valid string; "
            "allowed: dict[str, str] | None",
            id="agent-map-value",
        ),
        pytest.param(
            {"shard_size": 0, "strict": "yes"},
            "shard_size",
            "config key 'shard_size' is 0: Input should be greater than or equal to 1; allowed: int | None "
            "(>= 1); config key 'strict' is 'yes': Input should be a valid boolean; allowed: bool",
            id="two-bad-keys",
        ),
    ],
)
def test_bad_run_setting_names_key_value_and_allowed(cfg: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=_exact(message)) as info:
        RunSettings.from_config(cfg)
    assert info.value.key == key


def test_run_settings_ignore_server_instances_and_unknown_keys(tmp_path: Path, base: Path) -> None:
    settings = RunSettings.from_config(load_config([base]))
    assert settings.num_repeats == 1
    assert settings.max_connections == 256

"""A run against a NeMo Gym head server as 0.7's collector runs against it: routing keys checked against the
merged servers, a deployment config taken as it is, and 0.7's default head address (issue 31, items 1-3).

Every test runs the reference servers (``gym_ray.servers``) on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_ray import cli, keys
from gym_ray.config.run_config import DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT, resolve_run_config
from gym_ray.errors import ConfigError
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, calc_config, calc_rows, serve_config, start_in_thread

pytestmark = pytest.mark.timeout(60)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _two_envs() -> dict[str, Any]:
    """calc_config with a second environment server, other_env, in front of the same agent."""
    cfg = calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)
    cfg["other_env"] = json.loads(json.dumps(cfg["calc_env"]))
    return cfg


@pytest.fixture
async def two_envs() -> AsyncIterator[Deployment]:
    async with serve_config(_two_envs()) as dep:
        yield dep


def _head_only(dep: Deployment) -> dict[str, Any]:
    """What a NeMo Gym command line names: the head server, no server blocks."""
    return {"head_server": dict(dep.config["head_server"])}


def _materialized(n: int) -> list[dict[str, Any]]:
    return [
        {
            "task_id": {"taskset": "arith", "task_id": f"t{i}"},
            "task_input": {
                "responses_create_params": {"input": f"What is {i} + 1?"},
                "expected_answer": str(i + 1),
            },
        }
        for i in range(n)
    ]


# --- 1. routing keys against the servers the run uses (the head's) ----------------------------------------


async def test_legacy_mode_sends_every_row_to_a_server_the_head_declares(
    two_envs: Deployment, tmp_path: Path
) -> None:
    cfg = {
        **_head_only(two_envs),
        "environment_routing_mode": "legacy",
        "environment_server_name": "other_env",
    }
    result = await acollect_local(cfg, rows=calc_rows(3), output_jsonl_fpath=str(tmp_path / "r.jsonl"))
    assert result.succeeded == 3
    assert (two_envs.stats("other_env").requests, two_envs.stats("calc_env").requests) == (3, 0)
    rows = _lines(tmp_path / "r.jsonl")
    assert [(r[keys.ENVIRONMENT_SERVER], r[keys.AGENT_REF]) for r in rows] == [
        ("other_env", {"name": "calc_agent"})
    ] * 3


async def test_routes_send_materialized_rows_to_a_server_the_head_declares(
    two_envs: Deployment, tmp_path: Path
) -> None:
    cfg = {**_head_only(two_envs), "environment_server_routes": {"arith": "other_env"}}
    result = await acollect_local(cfg, rows=_materialized(2), output_jsonl_fpath=str(tmp_path / "r.jsonl"))
    assert result.succeeded == 2
    assert (two_envs.stats("other_env").requests, two_envs.stats("calc_env").requests) == (2, 0)
    rows = _lines(tmp_path / "r.jsonl")
    assert [(r["_ng_task_id"], r[keys.ENVIRONMENT_SERVER]) for r in rows] == [
        ({"taskset": "arith", "task_id": "t0"}, "other_env"),
        ({"taskset": "arith", "task_id": "t1"}, "other_env"),
    ]


def test_the_legacy_command_line_runs_against_the_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(2)), encoding="utf-8")
    with start_in_thread(_two_envs()) as servers:
        host, port = servers.head_url.removeprefix("http://").rsplit(":", 1)
        argv = [
            "run",
            f"+head_server.host={host}",
            f"+head_server.port={port}",
            "+environment_routing_mode=legacy",
            "+environment_server_name=other_env",
            f"+input_jsonl_fpath={inputs}",
            f"+output_jsonl_fpath={tmp_path / 'out' / 'r.jsonl'}",
            "--local",
        ]
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert (servers.stats("other_env").requests, servers.stats("calc_env").requests) == (2, 0)


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        pytest.param(
            {"environment_server_routes": {"arith": "othr_env"}},
            "config key 'environment_server_routes.arith' routes taskset 'arith' to 'othr_env', which is not "
            "an environment server of the config (did you mean 'other_env'?); environment servers: "
            "calc_env, other_env",
            id="route",
        ),
        pytest.param(
            {"environment_routing_mode": "legacy", "environment_server_name": "othr_env"},
            "config key 'environment_server_name' is 'othr_env', which is not an environment server of the "
            "config (did you mean 'other_env'?); environment servers: calc_env, other_env",
            id="legacy",
        ),
    ],
)
async def test_a_routing_key_naming_no_server_of_the_head_is_refused(
    two_envs: Deployment, routing: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        await resolve_run_config({**_head_only(two_envs), **routing})
    assert str(info.value) == message


# --- 2. a deployment config as it is -----------------------------------------------------------------------

#: A config as NeMo Gym's ng_run takes it: the policy_* values the model block interpolates, deployment keys,
#: server blocks without addresses (ng_run assigns them).
_DEPLOYMENT = """\
policy_base_url: http://127.0.0.1:8000/v1
policy_api_key: sk-local
policy_model_name: m1
uv_venv_dir: /opt/venvs
skip_venv_if_present: true
results_dir: results
cache_dir: cache
policy_model:
  responses_api_models:
    openai_model:
      entrypoint: app.py
      openai_base_url: ${policy_base_url}
      openai_api_key: ${policy_api_key}
      openai_model: ${policy_model_name}
      drop_input_reasoning_items: DROP
calc_agent:
  responses_api_agents:
    example_env:
      model_server: {type: responses_api_models, name: policy_model}
calc_env:
  environment_servers:
    example_env:
      seed: 3
      latency_ms: 1
      latency_jitter_ms: 0
      agent_server: {type: responses_api_agents, name: calc_agent}
"""


def _deployment(*, base_url: str = "http://127.0.0.1:8000/v1", drop: str = "false") -> dict[str, Any]:
    """What the head publishes for _DEPLOYMENT: its text (interpolations unresolved), addresses set."""
    cfg = yaml.safe_load(_DEPLOYMENT.replace("DROP", drop))
    cfg["policy_base_url"] = base_url
    cfg["head_server"] = {"host": "127.0.0.1", "port": 0}
    for name in ("calc_agent", "calc_env"):
        block = next(iter(next(iter(cfg[name].values())).values()))
        block.update(host="127.0.0.1", port=0)
    return cfg


def _head_overrides(dep: Deployment) -> list[str]:
    host, port = dep.head_url.removeprefix("http://").rsplit(":", 1)
    return [f"+head_server.host={host}", f"+head_server.port={port}"]


async def test_the_config_given_to_ng_run_runs_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "deployment.yaml"
    config.write_text(_DEPLOYMENT.replace("DROP", "false"), encoding="utf-8")
    async with serve_config(_deployment()) as dep:
        with caplog.at_level(logging.WARNING, logger="gym_ray"):
            result = await acollect_local(
                str(config),
                rows=calc_rows(2),
                overrides=[*_head_overrides(dep), f"+output_jsonl_fpath={tmp_path / 'r.jsonl'}"],
            )
        assert result.succeeded == 2
        assert dep.stats("calc_env").requests == 2
    notes = [r.getMessage() for r in caplog.records if r.name == "gym_ray.config.run_config"]
    assert notes == [
        "NeMo Gym deployment keys, not used by collection (they configure ng_run's servers): cache_dir, "
        "results_dir, skip_venv_if_present, uv_venv_dir"
    ]


def test_the_deployment_keys_are_named_in_one_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "deployment.yaml"
    config.write_text(_DEPLOYMENT.replace("DROP", "false"), encoding="utf-8")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(2)), encoding="utf-8")
    with start_in_thread(_deployment()) as servers:
        host, port = servers.head_url.removeprefix("http://").rsplit(":", 1)
        argv = [
            "run",
            str(config),
            f"+head_server.host={host}",
            f"+head_server.port={port}",
            f"+input_jsonl_fpath={inputs}",
            f"+output_jsonl_fpath={tmp_path / 'r.jsonl'}",
            "--local",
            "--progress",
            "off",
        ]
        assert cli.main(argv) == 0
    assert capsys.readouterr().err.splitlines() == [
        "gym-ray run: warning: NeMo Gym deployment keys, not used by collection (they configure ng_run's "
        "servers): cache_dir, results_dir, skip_venv_if_present, uv_venv_dir"
    ]
    assert len(_lines(tmp_path / "r.jsonl")) == 2


async def test_policy_values_no_block_interpolates_are_named_too(
    two_envs: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    policy = {"policy_base_url": "http://127.0.0.1:8000/v1", "policy_api_key": "k", "policy_model_name": "m1"}
    with caplog.at_level(logging.WARNING, logger="gym_ray"):
        run = await resolve_run_config({**_head_only(two_envs), **policy})
    assert run.topology.environment_servers() == ("calc_env", "other_env")
    assert [r.getMessage() for r in caplog.records if r.name == "gym_ray.config.run_config"] == [
        "NeMo Gym deployment keys, not used by collection (they configure ng_run's servers): policy_api_key, "
        "policy_base_url, policy_model_name"
    ]


async def test_a_head_value_that_cannot_be_resolved_here_is_not_compared(tmp_path: Path) -> None:
    config = tmp_path / "deployment.yaml"
    config.write_text(_DEPLOYMENT.replace("DROP", "true"), encoding="utf-8")
    # An environment variable unset here and a resolver only NeMo Gym registers.
    for unresolvable in ("${oc.env:GYM_RAY_TEST_UNSET_VARIABLE_31}", "${nemo_only_resolver:x}"):
        async with serve_config(_deployment(drop=unresolvable)) as dep:
            run = await resolve_run_config(str(config), overrides=_head_overrides(dep))
        fields = run.topology.instances["policy_model"].fields
        assert fields["drop_input_reasoning_items"] == unresolvable  # the head's block is the truth


async def test_a_head_value_that_resolves_to_another_value_is_a_conflict(tmp_path: Path) -> None:
    config = tmp_path / "deployment.yaml"
    config.write_text(_DEPLOYMENT.replace("DROP", "false"), encoding="utf-8")
    async with serve_config(_deployment(base_url="http://10.0.0.7:8000/v1")) as dep:
        with pytest.raises(ConfigError) as info:
            await resolve_run_config(str(config), overrides=_head_overrides(dep))
    assert str(info.value) == (
        "config key 'policy_model.responses_api_models.openai_model.openai_base_url' is "
        "'http://127.0.0.1:8000/v1' in the run's config but 'http://10.0.0.7:8000/v1' on the head server "
        "('${policy_base_url}' there); the running deployment is the truth: drop the local value or make it "
        "agree"
    )
    assert info.value.key == "policy_model.responses_api_models.openai_model.openai_base_url"


async def test_a_misspelt_deployment_key_is_still_refused(two_envs: Deployment) -> None:
    with pytest.raises(ConfigError) as info:
        await resolve_run_config({**_head_only(two_envs), "uv_venv_dirs": "/opt/venvs"})
    assert str(info.value) == (
        "config key 'uv_venv_dirs' is not a setting, a server instance or a key an interpolation refers to "
        "(did you mean 'uv_venv_dir'?). Settings are documented in docs/nemo-gym.md (NeMo Gym options) and "
        "gym_ray.config.settings.RunSettings (every setting)"
    )


@pytest.mark.parametrize(
    ("key", "asks", "default"),
    [
        pytest.param("observability_enabled", True, False, id="observability"),
        pytest.param("token_id_capture", {"enabled": True}, {"enabled": False}, id="token_ids"),
        pytest.param("telemetry", {"enabled": True}, {"enabled": False}, id="telemetry"),
    ],
)
async def test_a_deployment_key_that_changes_what_0_7_collects_is_refused_when_it_asks(
    two_envs: Deployment, key: str, asks: Any, default: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        await resolve_run_config({**_head_only(two_envs), key: asks})
    assert str(info.value).startswith(f"config key '{key}' ({asks!r}) is not supported: ")
    run = await resolve_run_config({**_head_only(two_envs), key: default})
    assert run.topology.environment_servers() == ("calc_env", "other_env")


# --- 3. NeMo Gym's default head address -------------------------------------------------------------------


@pytest.fixture
def nothing_at_the_default_head() -> Iterator[None]:
    """Holds 127.0.0.1:11000 bound and not listening, so a connection there is refused for the test's length
    (and nothing else can start listening there meanwhile)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT))
    except OSError as exc:
        sock.close()
        pytest.skip(f"{DEFAULT_HEAD_HOST}:{DEFAULT_HEAD_PORT} is in use on this machine ({exc.strerror})")
    try:
        yield
    finally:
        sock.close()


def test_the_default_head_address_is_nemo_gyms() -> None:
    # nemo_gym.global_config: DEFAULT_HEAD_SERVER_PORT = 11000; host: default_host, else 127.0.0.1.
    assert (DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT) == ("127.0.0.1", 11000)


@pytest.mark.usefixtures("nothing_at_the_default_head")
def test_no_head_at_the_default_address_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(2)), encoding="utf-8")
    out = tmp_path / "out" / "r.jsonl"
    argv = [
        "run",
        "+agent_name=calc_agent",
        f"+input_jsonl_fpath={inputs}",
        f"+output_jsonl_fpath={out}",
        "--local",
    ]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "gym-ray run: error: no head server answers at 127.0.0.1:11000, NeMo Gym's default head address (the "
        "config names no head_server and does not give every server's host and port); pass "
        "+head_server.host=... +head_server.port=... or a config naming the head (head_server: {host: ..., "
        "port: ...})\n"
    )
    assert not out.parent.exists()  # refused before anything was written


@pytest.mark.usefixtures("nothing_at_the_default_head")
async def test_server_blocks_without_addresses_ask_the_default_head() -> None:
    hostless = {"calc_agent": {"responses_api_agents": {"example_env": {}}}}
    with pytest.raises(ConfigError, match=r"^no head server answers at 127\.0\.0\.1:11000, ") as info:
        await resolve_run_config(hostless)
    assert info.value.key == "head_server"


@pytest.mark.usefixtures("nothing_at_the_default_head")
async def test_a_config_that_addresses_its_servers_asks_no_head() -> None:
    standalone = {"calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 9}}}}
    run = await resolve_run_config(standalone)
    assert (run.topology.head_url, run.topology.agents()) == (None, ("calc_agent",))


def test_a_head_at_the_default_address_serves_a_command_line_without_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = calc_config(seed=3, latency_ms=1, latency_jitter_ms=0)
    cfg["head_server"] = {"host": DEFAULT_HEAD_HOST, "port": DEFAULT_HEAD_PORT}
    try:
        servers = start_in_thread(cfg)
    except ConfigError as exc:  # the head could not listen there: the port is taken on this machine
        pytest.skip(f"{DEFAULT_HEAD_HOST}:{DEFAULT_HEAD_PORT} is in use on this machine ({exc})")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(row) + "\n" for row in calc_rows(3)), encoding="utf-8")
    out = tmp_path / "r.jsonl"
    with servers:
        argv = ["run", "+agent_name=calc_agent", f"+input_jsonl_fpath={inputs}", f"+output_jsonl_fpath={out}"]
        assert cli.main([*argv, "--local"]) == 0, capsys.readouterr().err
        assert servers.stats("calc_env").requests == 3
    assert [r[keys.ENVIRONMENT_SERVER] for r in _lines(out)] == ["calc_env"] * 3


async def test_a_head_server_block_with_a_port_only_takes_the_default_host(two_envs: Deployment) -> None:
    port = int(two_envs.head_url.rsplit(":", 1)[1])
    run = await resolve_run_config({"head_server": {"port": port}})
    assert run.topology.head_url == f"http://127.0.0.1:{port}"
    assert run.topology.environment_servers() == ("calc_env", "other_env")


@pytest.mark.parametrize(
    "host_keys",
    [
        pytest.param({"default_host": "127.0.0.2"}, id="default_host"),
        pytest.param({"use_absolute_ip": True}, id="use_absolute_ip"),
    ],
)
async def test_the_default_host_is_taken_as_0_7_takes_it(
    monkeypatch: pytest.MonkeyPatch, host_keys: dict[str, Any]
) -> None:
    # use_absolute_ip reads this host's IP (gethostbyname(gethostname())); here it is made 127.0.0.2, where
    # the head listens, since the machine's own address cannot be chosen by a test.
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.0.2")
    async with serve_config(_two_envs(), host="127.0.0.2") as dep:
        port = int(dep.head_url.rsplit(":", 1)[1])
        run = await resolve_run_config({**host_keys, "head_server": {"port": port}})
    assert run.topology.head_url == f"http://127.0.0.2:{port}"
    assert run.topology.environment_servers() == ("calc_env", "other_env")


async def test_a_server_block_the_head_lacks_still_needs_its_address(
    two_envs: Deployment, tmp_path: Path
) -> None:
    hostless_env = {
        "environment_servers": {
            "example_env": {"agent_server": {"type": "responses_api_agents", "name": "calc_agent"}}
        }
    }
    cfg = {
        **_head_only(two_envs),
        "local_env": hostless_env,
        "environment_routing_mode": "legacy",
        "environment_server_name": "local_env",
    }
    with pytest.raises(ConfigError, match=r"^server instance 'local_env' has no address") as info:
        await acollect_local(cfg, rows=calc_rows(1), output_dir=str(tmp_path / "run"))
    assert info.value.key == "local_env.environment_servers.example_env"

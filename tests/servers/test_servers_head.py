"""The head server and serve_config: published config, instances, health, threads, CLI registration."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
import yaml

from gym_ray.cli import COMMANDS
from gym_ray.errors import ConfigError
from gym_ray.servers import (
    bundled_config_path,
    bundled_dataset_path,
    load_bundled_config,
    serve_config,
    start_in_thread,
)
from gym_ray.servers.datagen import arithmetic_rows
from gym_ray.servers.head import HeadServer
from gym_ray.servers.launch import load_config_files


def _config() -> dict[str, Any]:
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "agent"},
                }
            }
        },
        "agent": {"responses_api_agents": {"example_env": {"port": 0, "seed": 3}}},
        "verifier": {"resources_servers": {"example_resources": {"port": 0}}},
        "remote_model": {"responses_api_models": {"openai_model": {"host": "10.0.0.9", "port": 8000}}},
        "environment_routing_mode": "agent",
    }


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def test_head_config_round_trip_is_json_string_of_yaml() -> None:
    cfg = _config()
    async with serve_config(cfg) as deployment, aiohttp.ClientSession() as session:
        status, body = await _get(session, deployment.head_url + "/global_config_dict_yaml")
    assert status == 200
    assert isinstance(body, str)
    assert yaml.safe_load(body) == deployment.config
    ports = {
        name: deployment.config[name][t][i]["port"]
        for name, t, i in (
            ("env", "environment_servers", "example_env"),
            ("agent", "responses_api_agents", "example_env"),
            ("verifier", "resources_servers", "example_resources"),
        )
    }
    assert all(isinstance(p, int) and p > 0 for p in ports.values())
    assert len(set(ports.values())) == 3
    assert deployment.config["head_server"]["port"] == int(deployment.head_url.rsplit(":", 1)[1])
    # the caller's config is never mutated; non-reference instances are left alone
    assert cfg == _config()
    assert deployment.config["remote_model"] == cfg["remote_model"]
    assert deployment.config["agent"]["responses_api_agents"]["example_env"]["host"] == "127.0.0.1"
    assert deployment.url_of("remote_model") == "http://10.0.0.9:8000"
    assert sorted(deployment.servers) == ["agent", "env", "verifier"]


async def test_head_server_instances_and_health() -> None:
    async with serve_config(_config()) as deployment, aiohttp.ClientSession() as session:
        status, instances = await _get(session, deployment.head_url + "/server_instances")
        health = [await _get(session, deployment.head_url + p) for p in ("/", "/livez", "/readyz")]
        env_health = await _get(session, deployment.url_of("env") + "/readyz")
    assert status == 200
    by_name = {i["name"]: i for i in instances}
    assert sorted(by_name) == ["agent", "env", "remote_model", "verifier"]
    env = by_name["env"]
    assert (env["server_type"], env["host"], env["url"]) == (
        "environment_servers",
        "127.0.0.1",
        deployment.url_of("env"),
    )
    assert env["port"] == int(deployment.url_of("env").rsplit(":", 1)[1])
    assert isinstance(env["pid"], int)
    assert health == [(200, {"status": "ok"})] * 3
    assert env_health == (200, {"status": "ok"})


async def test_head_readyz_is_503_until_marked_ready() -> None:
    from gym_ray.servers import _web

    head = HeadServer({"a": 1})
    runner = _web.make_runner(head.make_app())
    await runner.setup()
    try:
        from aiohttp import web

        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{_web.bound_port(runner)}"
        async with aiohttp.ClientSession() as session:
            before = await _get(session, url + "/readyz")
            live = await _get(session, url + "/livez")
            head.mark_ready()
            after = await _get(session, url + "/readyz")
    finally:
        await runner.cleanup()
    assert before == (503, {"status": "starting"})
    assert live == (200, {"status": "ok"})
    assert after == (200, {"status": "ok"})


async def test_head_server_added_when_config_has_none() -> None:
    cfg = _config()
    del cfg["head_server"]
    async with serve_config(cfg) as deployment:
        assert deployment.config["head_server"]["host"] == "127.0.0.1"
        assert deployment.config["head_server"]["port"] > 0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        pytest.param({"latency_ms": -1}, "env.environment_servers.example_env.latency_ms = -1", id="latency"),
        pytest.param({"skill": 2}, "env.environment_servers.example_env.skill", id="skill"),
        pytest.param({"seed": "x"}, "env.environment_servers.example_env.seed = 'x'", id="seed"),
        pytest.param({"port": 70000}, "env.port = 70000", id="port"),
        pytest.param(
            {"faults": {"error_rate": 0.7, "hang_rate": 0.5}},
            "env.environment_servers.example_env.faults rates sum to 1.2",
            id="fault-rates",
        ),
        pytest.param({"faults": {"eror_rate": 0.1}}, "unknown field(s) ['eror_rate']", id="fault-typo"),
    ],
)
async def test_bad_instance_fields_raise_config_error_naming_the_path(
    patch: dict[str, Any], message: str
) -> None:
    cfg = _config()
    cfg["env"]["environment_servers"]["example_env"].update(patch)
    with pytest.raises(ConfigError) as info:
        async with serve_config(cfg):
            pass
    assert message in str(info.value)


def test_start_in_thread_serves_until_closed() -> None:
    import urllib.request

    with start_in_thread(_config()) as servers:
        with urllib.request.urlopen(servers.head_url + "/global_config_dict_yaml") as resp:
            published = yaml.safe_load(json.loads(resp.read()))
        assert published == servers.config
        servers.set_skill("env", 0.75)
        with urllib.request.urlopen(servers.url_of("env") + "/policy") as resp:
            assert json.loads(resp.read())["skill"] == 0.75
        assert servers.stats("env").requests == 0
        servers.reset_stats()
    with pytest.raises(ConfigError, match="closed"):
        servers.stats("env")


def test_start_in_thread_reraises_config_errors() -> None:
    cfg = _config()
    cfg["env"]["environment_servers"]["example_env"]["skill"] = -0.5
    with pytest.raises(ConfigError, match="skill"):
        start_in_thread(cfg)


async def test_bundled_demo_config_serves_every_instance() -> None:
    cfg = load_bundled_config()
    dataset = cfg["arith_agent"]["responses_api_agents"]["example_env"]["datasets"][0]["jsonl_fpath"]
    assert dataset == str(bundled_dataset_path())
    async with serve_config(cfg) as deployment:
        assert sorted(deployment.servers) == [
            "arith_agent",
            "arith_agent_hard",
            "arith_env",
            "arith_env_hard",
            "arith_resources",
        ]


def test_bundled_dataset_is_the_generator_output() -> None:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == arithmetic_rows()
    assert len(lines) == 200


def test_load_config_files_merges_overrides(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(bundled_config_path().read_text(encoding="utf-8"), encoding="utf-8")
    cfg = load_config_files([str(path)], ["arith_env.environment_servers.example_env.skill=0.25"])
    assert cfg["arith_env"]["environment_servers"]["example_env"]["skill"] == 0.25
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_files([str(tmp_path / "missing.yaml")])


def test_serve_is_registered_in_the_cli() -> None:
    assert COMMANDS["serve"][1] == "gym_ray.servers.launch:serve_main"


@pytest.mark.parametrize("sig", [pytest.param("SIGTERM", id="sigterm"), pytest.param("SIGINT", id="ctrl-c")])
def test_gym_ray_serve_cli_runs_until_signalled(sig: str, tmp_path: Any) -> None:
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gym_ray.cli",
            "serve",
            str(bundled_config_path()),
            "arith_env.environment_servers.example_env.seed=9",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("  gym-ray run "):
            line = proc.stdout.readline()
            assert line, lines
            lines.append(line.rstrip("\n"))
        lines, told = lines[:-2], lines[-2:]
        head_url = lines[-1].removeprefix("head server: ")
        with urllib.request.urlopen(head_url + "/global_config_dict_yaml") as resp:
            published = yaml.safe_load(json.loads(resp.read()))
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert published["arith_env"]["environment_servers"]["example_env"]["seed"] == 9
    names = sorted(line.split(" ")[0] for line in lines[:-1])
    assert names == ["arith_agent", "arith_agent_hard", "arith_env", "arith_env_hard", "arith_resources"]
    port = int(head_url.rsplit(":", 1)[1])
    assert (told, out.splitlines()) == (
        [
            "wrote gym-ray-run.yaml (the head server's address); collect your rows with:",
            "  gym-ray run gym-ray-run.yaml +input_jsonl_fpath=ROWS.jsonl +output_dir=runs/r1",
        ],
        ["stopping"],
    )
    assert yaml.safe_load((tmp_path / "gym-ray-run.yaml").read_text()) == {
        "head_server": {"host": "127.0.0.1", "port": port}
    }


def test_gym_ray_serve_reports_a_missing_file(tmp_path: Any) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "gym_ray.cli", "serve", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "nope.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr

"""gym_ray.config.run_config: the run config built once at the edge and shipped to actors as an object."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig, merge_run_config, resolve_run_config
from gym_ray.config.topology import Topology
from gym_ray.errors import ConfigError, ServerConnectionError, UsageError
from gym_ray.servers import load_bundled_config
from gym_ray.servers.launch import start_in_thread


def test_from_dict_parses_settings_topology_and_tracing_once() -> None:
    cfg = {**load_bundled_config(), "num_repeats": 3, "tracing": {"enabled": True, "exporter": "memory"}}
    run = RunConfig.from_dict(cfg)
    assert run.settings.num_repeats == 3
    assert run.topology.environment_servers() == ("arith_env", "arith_env_hard")
    assert (run.tracing.enabled, run.tracing.exporter) == (True, "memory")


def test_a_pickled_run_config_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunConfig.from_dict({**load_bundled_config(), "max_resident_tasks": 7})
    data = pickle.dumps(run)

    def refuse(cls: Any, cfg: Any) -> Topology:
        raise AssertionError("Topology.from_config called while unpickling")

    monkeypatch.setattr(Topology, "from_config", classmethod(refuse))
    copy = pickle.loads(data)
    assert copy.settings.max_resident_tasks == 7
    assert copy.topology.identity_digest() == run.topology.identity_digest()
    assert copy.topology.raw == run.topology.raw
    assert copy.topology.url_of("arith_env") == run.topology.url_of("arith_env")


def test_with_settings_checks_the_new_values() -> None:
    run = RunConfig.from_dict({"max_resident_tasks": 4})
    assert run.with_settings(max_resident_tasks=9).settings.max_connections == 9
    with pytest.raises(ConfigError, match="max_resident_tasks"):
        run.with_settings(max_resident_tasks=0)


def test_merge_refuses_overrides_with_a_dict() -> None:
    with pytest.raises(UsageError, match="overrides apply to YAML config files"):
        merge_run_config({"a": 1}, overrides=["+b=2"])


async def test_a_bad_setting_fails_before_the_head_server_is_asked() -> None:
    cfg = {"head_server": {"host": "127.0.0.1", "port": 9}, "max_resident_tasks": "many"}
    with pytest.raises(ConfigError, match="config key 'max_resident_tasks'"):
        await resolve_run_config(cfg)
    with pytest.raises(ServerConnectionError):
        await resolve_run_config({"head_server": {"host": "127.0.0.1", "port": 9}}, client_timeout_s=2)


async def test_a_head_only_config_is_completed_from_the_head_and_its_own_keys_win() -> None:
    with start_in_thread(load_bundled_config()) as servers:
        host, port = servers.head_url.removeprefix("http://").rsplit(":", 1)
        head = {"head_server": {"host": host, "port": int(port)}, "num_repeats": 5}
        run = await resolve_run_config(head, settings={"output_dir": "runs/x"})
    assert run.topology.environment_servers() == ("arith_env", "arith_env_hard")
    assert (run.settings.num_repeats, run.settings.output_dir) == (5, "runs/x")
    assert await resolve_run_config(run) is run


def test_a_value_the_head_redacted_agrees_with_the_runs_own_secret() -> None:
    from gym_ray import keys
    from gym_ray.config.run_config import overlay_on_head

    def env(judge: dict[str, Any]) -> dict[str, Any]:
        return {"environment_servers": {"example_env": {"host": "h", "port": 1, "judge": judge}}}

    head = {"calc_env": env({"auth_token": keys.REDACTED, "model": "judge-1"})}
    local = {"calc_env": env({"auth_token": "sk-real", "model": "judge-1"}), "num_repeats": 2}
    merged = overlay_on_head(head, local)
    assert merged == {"calc_env": head["calc_env"], "num_repeats": 2}  # the head's block: the truth
    with pytest.raises(ConfigError, match=r"calc_env\.environment_servers\.example_env\.judge"):
        overlay_on_head(head, {"calc_env": env({"auth_token": "sk-real", "model": "judge-2"})})

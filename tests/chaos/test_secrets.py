"""R20: a secret in the config (api key, password, token) is absent from every reply of the head server
without its token, and from every file, log line, progress line and span a run writes."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gym_ray.record.ledger import check_run
from gym_ray.run.collect import acollect_local
from gym_ray.servers import serve_config
from gym_ray.servers.redaction import REDACTED, is_loopback
from tests.chaos.test_server_outage import _config, _rows

SECRETS = {
    "policy_api_key": "sk-SEEDED-api-key-7f3a9",
    "password": "SEEDED-password-41c2",
    "token": "SEEDED-token-9d0e",
}


def _seeded_config() -> dict[str, Any]:
    cfg = _config(latency_ms=0)
    cfg["policy_api_key"] = SECRETS["policy_api_key"]
    cfg["database"] = {"user": "gym", "Password": SECRETS["password"]}
    env = cfg["calc_env"]["environment_servers"]["example_env"]
    env["judge"] = {"auth_token": SECRETS["token"], "model": "judge-1"}
    return cfg


async def _published(head_url: str, authorization: str | None = None) -> tuple[str, dict[str, Any]]:
    headers = {"Authorization": authorization} if authorization else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(head_url + "/global_config_dict_yaml", headers=headers) as resp,
    ):
        assert resp.status == 200
        raw = await resp.text()
    return raw, yaml.safe_load(json.loads(raw))


def _files_under(root: Path) -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8", errors="replace") for p in root.rglob("*") if p.is_file()}


def _leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


async def test_the_head_server_redacts_secrets_unless_the_token_is_presented() -> None:
    async with serve_config(_seeded_config(), token="head-token-1") as dep:
        raw, public = await _published(dep.head_url)
        assert _leaks(raw) == []
        assert public["policy_api_key"] == REDACTED
        assert public["database"] == {"user": "gym", "Password": REDACTED}
        judge = public["calc_env"]["environment_servers"]["example_env"]["judge"]
        assert judge == {"auth_token": REDACTED, "model": "judge-1"}
        assert public["calc_env"]["environment_servers"]["example_env"]["port"] == int(
            dep.url_of("calc_env").rsplit(":", 1)[1]
        )
        raw_wrong, _ = await _published(dep.head_url, "Bearer head-token-2")
        assert _leaks(raw_wrong) == []
        raw_full, full = await _published(dep.head_url, "Bearer head-token-1")
        assert sorted(_leaks(raw_full)) == sorted(SECRETS)
        assert full["database"]["Password"] == SECRETS["password"]


async def test_a_non_loopback_head_server_gets_a_generated_token() -> None:
    assert (
        is_loopback("127.0.0.1"),
        is_loopback("::1"),
        is_loopback("0.0.0.0"),
        is_loopback("10.1.2.3"),
    ) == (
        True,
        True,
        False,
        False,
    )
    async with serve_config(_seeded_config(), host="0.0.0.0", advertise_host="127.0.0.1") as dep:
        assert dep.token_generated
        assert dep.head_token is not None
        assert len(dep.head_token) >= 32
        raw, _ = await _published(dep.head_url)
        assert _leaks(raw) == []
        raw_full, _ = await _published(dep.head_url, f"Bearer {dep.head_token}")
        assert sorted(_leaks(raw_full)) == sorted(SECRETS)
    async with serve_config(_seeded_config()) as local:
        assert (local.head_token, local.token_generated) == (None, False)
        raw_local, _ = await _published(local.head_url, "Bearer anything")
        assert _leaks(raw_local) == []


async def test_nothing_a_run_writes_contains_a_seeded_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    spans = tmp_path / "spans.jsonl"
    caplog.set_level(logging.DEBUG)
    async with serve_config(_seeded_config()) as dep:
        cfg = copy.deepcopy(dep.config)
        # As in NeMo Gym configs, the top-level secrets are what server fields interpolate (a run's config
        # holds no key that is neither a setting, a server nor an interpolation's target).
        fields = cfg["calc_env"]["environment_servers"]["example_env"]
        fields["policy_key"], fields["db_password"] = "${policy_api_key}", "${database.Password}"
        cfg["tracing"] = {"enabled": True, "exporter": "file", "file_path": str(spans)}
        result = await acollect_local(cfg, rows=_rows(20), output_dir=str(out), progress=True)
    assert result.succeeded == 20
    assert check_run(out).ok
    written = _files_under(tmp_path)
    assert spans in written
    assert out / "rollouts.jsonl" in written
    assert {path.name: _leaks(text) for path, text in written.items() if _leaks(text)} == {}
    captured = capsys.readouterr()
    assert _leaks(captured.out + captured.err) == []
    assert caplog.records  # the run logged (sessions, limits), and none of it is secret
    assert _leaks(caplog.text) == []

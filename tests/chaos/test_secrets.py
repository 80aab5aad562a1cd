"""R20: a secret in the config (api key, password, token, ...) is absent from every reply of the head server
without its token, and from every file, log line, progress line and span a run writes.

Table-driven: :data:`SEEDS` seeds each of :data:`DEFAULT_SECRET_PATTERNS` with a key that only it matches
(at some depth of the served config, in mixed case), so a pattern dropped from the defaults fails here.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gym_ray.record.ledger import check_run
from gym_ray.run.collect import acollect_local
from gym_ray.servers import serve_config
from gym_ray.servers.redaction import DEFAULT_SECRET_PATTERNS, REDACTED, is_loopback, is_secret_key
from tests.chaos.test_server_outage import _config, _rows

_ENV = ("calc_env", "environment_servers", "example_env")


@dataclass(frozen=True)
class Seed:
    """A secret seeded in the served config: the one default ``pattern`` its key matches, where the key
    sits (``path``, the key last) and its ``value``."""

    pattern: str
    path: tuple[str, ...]
    value: str


SEEDS = (
    Seed("*api_key*", ("policy_api_key",), "sk-SEEDED-api-key-7f3a9"),
    Seed("*apikey*", (*_ENV, "OPENAI_APIKEY"), "SEEDED-apikey-2b61"),
    Seed("*token*", (*_ENV, "judge", "auth_token"), "SEEDED-token-9d0e"),
    Seed("*password*", ("database", "Password"), "SEEDED-password-41c2"),
    Seed("*secret*", (*_ENV, "oauth", "client_secret"), "SEEDED-secret-5e88"),
    Seed("*authorization*", (*_ENV, "judge", "headers", "Authorization"), "Bearer SEEDED-authorization-c03d"),
    Seed("*credential*", (*_ENV, "gcp_credentials"), "SEEDED-credentials-7a1f"),
    Seed("*private_key*", (*_ENV, "ssh_private_key"), "SEEDED-private-key-88b2"),
    Seed("*privatekey*", (*_ENV, "signing", "PrivateKey"), "SEEDED-privatekey-3c9e"),
    Seed("*access_key*", (*_ENV, "storage", "aws_access_key_id"), "SEEDED-access-key-0d4e"),
    Seed("*accesskey*", (*_ENV, "storage", "minioAccessKey"), "SEEDED-accesskey-61f0"),
)
#: Keys beside the seeds that are not secret: published as they are.
NOT_SECRET = {
    ("database", "user"): "gym",
    (*_ENV, "judge", "model"): "judge-1",
    (*_ENV, "oauth", "client_id"): "gym-client",
    (*_ENV, "storage", "bucket"): "rollouts",
}


def _at(cfg: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        cfg = cfg[key]
    return cfg


def _put(cfg: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        cfg = cfg.setdefault(key, {})
    cfg[path[-1]] = value


def _seeded_config() -> dict[str, Any]:
    cfg = _config(latency_ms=0)
    for path, value in NOT_SECRET.items():
        _put(cfg, path, value)
    for seed in SEEDS:
        _put(cfg, seed.path, seed.value)
    return cfg


def test_each_default_pattern_has_a_seed_that_only_it_matches() -> None:
    # A pattern dropped from (or added to) the defaults without its seed here fails the first line.
    assert tuple(seed.pattern for seed in SEEDS) == DEFAULT_SECRET_PATTERNS
    keys = [seed.path[-1] for seed in SEEDS]
    matched = {key: [p for p in DEFAULT_SECRET_PATTERNS if is_secret_key(key, [p])] for key in keys}
    assert matched == {seed.path[-1]: [seed.pattern] for seed in SEEDS}
    assert [key for key in keys if not is_secret_key(key)] == []  # the defaults, case-insensitively
    # The keys on the way to the seeds, and their neighbours, are not secret (else a whole block hides).
    on_the_way = {key for seed in SEEDS for key in seed.path[:-1]} | {path[-1] for path in NOT_SECRET}
    assert sorted(key for key in on_the_way if is_secret_key(key)) == []


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
    """The patterns whose seeded value appears in ``text``."""
    return [seed.pattern for seed in SEEDS if seed.value in text]


ALL = [seed.pattern for seed in SEEDS]  # every seed, by the pattern it stands for


async def test_the_head_server_redacts_secrets_unless_the_token_is_presented() -> None:
    async with serve_config(_seeded_config(), token="head-token-1") as dep:
        raw, public = await _published(dep.head_url)
        assert _leaks(raw) == []
        assert {seed.pattern: _at(public, seed.path) for seed in SEEDS} == dict.fromkeys(ALL, REDACTED)
        assert {path: _at(public, path) for path in NOT_SECRET} == NOT_SECRET
        assert _at(public, (*_ENV, "port")) == int(dep.url_of("calc_env").rsplit(":", 1)[1])
        raw_wrong, _ = await _published(dep.head_url, "Bearer head-token-2")
        assert _leaks(raw_wrong) == []
        raw_full, full = await _published(dep.head_url, "Bearer head-token-1")
        assert _leaks(raw_full) == ALL
        assert {seed.pattern: _at(full, seed.path) for seed in SEEDS} == {s.pattern: s.value for s in SEEDS}
        assert {path: _at(full, path) for path in NOT_SECRET} == NOT_SECRET


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
        assert _leaks(raw_full) == ALL
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
        assert _leaks(json.dumps(cfg)) == ALL  # the run is handed every seeded secret
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

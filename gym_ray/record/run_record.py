"""What ran in a run folder (``gym_ray_run.json``): the resolved topology, the settings and the input.

A run writes this record once it holds its folder (:func:`gym_ray.record.run_lock.holding_run_folder`),
after its checks passed; a resume writes it again. It holds:

- ``topology``: the head server's address, every server instance's URL, the routing keys and the
  config's identity (the digest of what decides results,
  :meth:`~gym_ray.config.topology.Topology.identity_digest`);
- ``settings``: the run settings as resolved;
- ``config``: the whole resolved config the run used (the head's servers with the run's own keys), from
  which ``gym-ray aggregate RUN_DIR`` rebuilds the topology, so it talks to the servers the run talked to
  whatever a config file says later (``gym-ray serve`` rewrites its ``gym-ray-run.yaml`` every time);
- ``input``: the input's identity: a file's absolute path, size and SHA-256 (computed before Ray starts,
  ~0.8 s per GB), or, for rows passed from Python, their number and a digest of their canonical JSON.

Secrets are left out: every value under a key matching the head server's secret patterns
(:data:`gym_ray.servers.redaction.DEFAULT_SECRET_PATTERNS`, kept in :mod:`gym_ray._redact`, plus the
config's own ``head_server.secret_patterns``) is replaced by the redaction marker, at any depth, in
``settings`` and ``config``.

Folders written before this format (``format_version`` 1: ``{"config": [paths], "overrides": [...]}``)
are read as such; :func:`read_record` returns them as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from gym_ray._redact import DEFAULT_SECRET_PATTERNS, redact
from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.errors import UsageError
from gym_ray.record.run_lock import RUN_RECORD_FILE

__all__ = [
    "PLAN_SETTINGS",
    "RECORD_FORMAT",
    "RUN_RECORD_FILE",
    "build_record",
    "encode_record",
    "input_change",
    "input_identity",
    "read_record",
    "recorded_run_config",
    "secret_patterns",
    "settings_changes",
    "topology_changes",
    "topology_record",
]

#: The record's format version (1: the config's paths and overrides only).
RECORD_FORMAT = 2
#: Settings that decide how the input is cut into rollouts: a resume must keep them.
PLAN_SETTINGS = (
    "num_repeats",
    "fan_out",
    "agent_map",
    "num_repeats_add_seed",
    "interleave_repeats",
    "task_ids",
    "limit",
    "responses_create_params",
    "shard_size",
)
_BLOCK = 1 << 20


def input_identity(settings: RunSettings, rows: Iterable[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The identity of a run's input: a file's path, size and SHA-256, or rows' count and digest.

    Rows passed as a sequence are digested as canonical JSON lines (sorted keys; orjson, ~4 us per row,
    or ``json`` for a row orjson cannot encode); rows from an iterator are not read here (``count`` and
    ``sha256`` are None).

    Raises:
        OSError: The input file cannot be read (the preflight has checked it just before).
    """
    if rows is not None:
        if not isinstance(rows, Sequence):
            return {"kind": "rows", "count": None, "sha256": None}
        digest = hashlib.sha256()
        for row in rows:
            digest.update(_canonical_line(row))
        return {"kind": "rows", "count": len(rows), "sha256": digest.hexdigest()}
    path = str(settings.input_jsonl_fpath)
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            size += len(block)
            digest.update(block)
    return {"kind": "file", "path": os.path.abspath(path), "size": size, "sha256": digest.hexdigest()}


def _canonical_line(row: Any) -> bytes:
    try:
        return orjson.dumps(row, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)
    except (TypeError, orjson.JSONEncodeError):  # integers past 64 bits, non-string keys, ...
        pass
    try:
        text = json.dumps(row, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):  # keys that do not sort: the row's validation refuses it later
        text = repr(row)
    return text.encode("utf-8", "surrogatepass") + b"\n"


def topology_record(topology: Topology) -> dict[str, Any]:
    """The resolved topology as the record holds it: head address, server URLs, routing, identity."""
    servers = {
        name: (f"http://{inst.host}:{inst.port}" if inst.host is not None and inst.port is not None else None)
        for name, inst in topology.instances.items()
    }
    return {
        "head_url": topology.head_url,
        "servers": servers,
        "routing": {
            "mode": topology.routing_mode,
            "environment_server_routes": dict(topology.routes),
            "environment_server_name": topology.environment_server_name,
            "agent_map": dict(topology.agent_map),
        },
        "identity": topology.identity_digest(),
    }


def secret_patterns(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The key patterns whose values the record leaves out: the head server's defaults and the config's
    own ``head_server.secret_patterns``."""
    head = raw.get("head_server")
    listed = head.get("secret_patterns") if isinstance(head, Mapping) else None
    extra = tuple(str(p) for p in listed) if isinstance(listed, list) else ()
    return (*DEFAULT_SECRET_PATTERNS, *extra)


def build_record(run: RunConfig, input_id: Mapping[str, Any]) -> dict[str, Any]:
    """The record of a run about to start: topology, settings and config (secrets redacted), input."""
    raw = run.topology.raw
    patterns = secret_patterns(raw)
    return {
        "format_version": RECORD_FORMAT,
        "recorded_at": time.time(),
        "input": dict(input_id),
        "topology": topology_record(run.topology),
        "settings": redact(run.settings.model_dump(mode="json"), patterns),
        "config": redact(raw, patterns),
    }


def encode_record(record: Mapping[str, Any]) -> bytes:
    """The record's bytes as written to ``gym_ray_run.json``."""
    return (json.dumps(record, indent=2, default=str) + "\n").encode()


def read_record(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The folder's run record (any format version), or None when it has none.

    Raises:
        UsageError: The file is there but is not a JSON object.
    """
    path = Path(run_dir) / RUN_RECORD_FILE
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{path} cannot be read ({exc}); move it aside, or pass the config explicitly"
        ) from exc
    if not isinstance(body, dict):
        raise UsageError(f"{path} does not hold a JSON object; move it aside, or pass the config explicitly")
    body.setdefault("format_version", 1)
    return body


def recorded_run_config(record: Mapping[str, Any], run_dir: str | os.PathLike[str]) -> RunConfig:
    """The run's config rebuilt from a format-2 record (no network call: the recorded servers).

    Raises:
        UsageError: The record holds no usable config.
    """
    config = record.get("config")
    if not isinstance(config, dict):
        raise UsageError(
            f"{Path(run_dir) / RUN_RECORD_FILE} holds no config; pass the config explicitly with "
            "--use-new-config"
        )
    return RunConfig.from_dict(config)


def topology_changes(record: Mapping[str, Any], topology: Topology) -> list[str]:
    """How ``topology`` differs from the recorded one: head address, instances and their URLs, routing
    and identity, one phrase each (``[]`` when it names the same servers)."""
    old = record.get("topology")
    if not isinstance(old, Mapping):
        return []
    new = topology_record(topology)
    changes = []
    if old.get("head_url") != new["head_url"]:
        changes.append(f"head server {old.get('head_url')} -> {new['head_url']}")
    before = old.get("servers") if isinstance(old.get("servers"), Mapping) else {}
    assert isinstance(before, Mapping)
    for name in sorted(set(before) | set(new["servers"])):
        was, now = before.get(name), new["servers"].get(name)
        if name not in before:
            changes.append(f"{name} added ({now})")
        elif name not in new["servers"]:
            changes.append(f"{name} gone (was {was})")
        elif was != now:
            changes.append(f"{name} {was} -> {now}")
    if old.get("routing") != new["routing"]:
        changes.append("routing keys differ")
    if old.get("identity") != new["identity"] and not changes:
        changes.append("server settings differ (config identity)")
    return changes


def input_change(record: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """Why the input ``now`` is not the recorded one (None when it is, or when they cannot be compared)."""
    old = record.get("input")
    if not isinstance(old, Mapping) or old.get("kind") != now.get("kind"):
        return None
    if old.get("sha256") is None or now.get("sha256") is None or old.get("sha256") == now.get("sha256"):
        return None
    if now.get("kind") == "file":
        return (
            f"the run was planned from {old.get('path')} ({old.get('size')} bytes, sha256 "
            f"{str(old.get('sha256'))[:12]}...); the input given now, {now.get('path')} ({now.get('size')} "
            f"bytes, sha256 {str(now.get('sha256'))[:12]}...), differs"
        )
    return (
        f"the run was planned from {old.get('count')} rows (sha256 {str(old.get('sha256'))[:12]}...); the "
        f"{now.get('count')} rows given now (sha256 {str(now.get('sha256'))[:12]}...) differ"
    )


def settings_changes(
    record: Mapping[str, Any], settings: RunSettings, patterns: Iterable[str] = DEFAULT_SECRET_PATTERNS
) -> list[str]:
    """The :data:`PLAN_SETTINGS` whose value differs from the recorded one, as ``key: old -> new``.

    The new values are redacted with ``patterns`` first, as the record's were (a secret in
    ``responses_create_params`` compares as the marker; its value is never shown). ``shard_size`` unset
    now means "the folder's own" and matches; ``limit`` 0 and unset are the same.
    """
    old = record.get("settings")
    if not isinstance(old, Mapping):
        return []
    new = redact(settings.model_dump(mode="json"), tuple(patterns))
    changes = []
    for key in PLAN_SETTINGS:
        was, now = old.get(key), new.get(key)
        if key == "shard_size" and now is None:
            continue
        if key == "limit":
            was, now = was or None, now or None
        if was != now:
            changes.append(f"{key}: {json.dumps(was)} -> {json.dumps(now)}")
    return changes

"""A run folder's manifest (``run_manifest.json``): the run's id, config identity, size and shard cut.

Written by planning (atomically replaced) before the first shard (so the run id survives a kill while
planning) and again after the last; read by resume, status, the ledger and the preflight.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from gym_ray.errors import ResumeError
from gym_ray.plan.resume import verify_recorded_inputs
from gym_ray.record.atomic import atomic_write_bytes

__all__ = ["RUN_MANIFEST", "open_run", "other_config_error", "read_run_manifest", "write_run_manifest"]


RUN_MANIFEST = "run_manifest.json"


def read_run_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run manifest of ``run_dir``, or None when there is none.

    Raises:
        ResumeError: The file is there but unreadable or not a JSON object.
    """
    path = run_dir / RUN_MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResumeError(
            f"{path} is not a readable run manifest ({exc}); move the folder aside or pass a new output_dir"
        ) from exc
    if not isinstance(data, dict):
        raise ResumeError(
            f"{path} does not hold a JSON object; move the folder aside or pass a new output_dir"
        )
    return data


def open_run(
    root: Path, config_identity: str | None, run_id: str | None
) -> tuple[str, dict[str, Any] | None]:
    """The run id of ``root`` (kept from its run manifest on resume) and that manifest, if any."""
    existing = read_run_manifest(root)
    if existing is not None:
        refused = other_config_error(root, existing.get("config_identity"), config_identity)
        if refused is not None:
            raise refused
        verify_recorded_inputs(root)  # a resume: damaged inputs stop it before anything is dispatched
        run_id = str(existing["run_id"])
    return run_id or uuid.uuid4().hex[:12], existing


def other_config_error(root: Path, recorded: Any, config_identity: str | None) -> ResumeError | None:
    """The refusal of a resume whose config identity is not the one ``root`` recorded (None: it is)."""
    if not recorded or not config_identity or recorded == config_identity:
        return None
    return ResumeError(
        f"{root} was collected with another configuration (identity {str(recorded)[:12]}..., now "
        f"{config_identity[:12]}...): servers, routing or sampling settings changed. Resume with the "
        "config that started the run, or pass a new output_dir"
    )


def write_run_manifest(
    root: Path,
    existing: dict[str, Any] | None,
    *,
    run_id: str,
    config_identity: str | None,
    shard_size: int,
    num_shards: int | None,
    planned: int | None,
    run_rows: int | None = None,
) -> None:
    manifest = {
        "run_id": run_id,
        "config_identity": config_identity,
        "num_shards": num_shards,
        "planned": planned,
        # The run's full size, known from the validation pass before the first shard is cut: an interrupted
        # run's status counts the rows not planned yet (gym_ray.record.status, gym_ray.record.ledger).
        "run_rows": run_rows if run_rows is not None else (existing or {}).get("run_rows"),
        "shard_size": shard_size,
        "created_at": existing.get("created_at") if existing else time.time(),
    }
    atomic_write_bytes(root / RUN_MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())

"""The run folder against the command, checked before Ray starts and before the folder is locked.

:func:`check_run_folder` runs at the edge of every whole-config run, after the preflight
(:mod:`gym_ray.run.preflight`) and before :func:`~gym_ray.record.run_lock.holding_run_folder` takes the
folder: a refused command therefore writes nothing to the folder (not even the lock file's holder
description), and every refusal comes in well under a second plus one read of the input file (its
SHA-256, which the run record keeps). In order:

1. a folder another process holds is refused (``RunLockError`` naming the holder, as a second run is);
   with no run in the folder, ``resume_from_cache: true`` where ``output_jsonl_fpath`` already has files
   (NeMo Gym 0.7's own output, which gym_ray cannot resume) is refused;
2. when the folder holds a run (``run_manifest.json``), the command must resume that run:
   ``resume_from_cache: false`` is refused; the config's identity (what decides results:
   :meth:`~gym_ray.config.topology.Topology.identity_digest`) must be the run manifest's; and, with a run
   record (:mod:`gym_ray.record.run_record`), the input (file content or rows), the settings that decide
   the plan (:data:`~gym_ray.record.run_record.PLAN_SETTINGS`) and the servers' addresses must be the
   recorded ones. Addresses that moved (a second ``gym-ray serve`` rewrote ``gym-ray-run.yaml`` with new
   ports) are refused unless the run says so: ``use_new_config`` (``gym-ray run --use-new-config``).

Each refusal is a :class:`~gym_ray.errors.ResumeError` (exit status 2) naming the folder, what was
recorded and what the command gives. The returned :class:`FolderCheck` carries the new run record and the
bytes the checks read, which :func:`holding_run_folder` verifies again once it holds the lock.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_ray.config.run_config import RunConfig
from gym_ray.errors import ResumeError
from gym_ray.finalize.nemo_layout import nemo_gym_paths
from gym_ray.plan.run_manifest import RUN_MANIFEST, other_config_error, read_run_manifest
from gym_ray.record.run_lock import refuse_if_held
from gym_ray.record.run_record import (
    RUN_RECORD_FILE,
    build_record,
    encode_record,
    input_change,
    input_identity,
    secret_patterns,
    settings_changes,
    topology_changes,
)

__all__ = ["FolderCheck", "check_run_folder"]


@dataclass(frozen=True)
class FolderCheck:
    """What :func:`check_run_folder` found: the record to write and the bytes its checks read.

    Attributes:
        record: The new run record, encoded (``gym_ray_run.json``).
        expect: File name -> its bytes when checked (None: absent), for
            :func:`~gym_ray.record.run_lock.holding_run_folder`'s ``expect``.
        resumed: The folder held a run (this command resumes it).
    """

    record: bytes
    expect: Mapping[str, bytes | None] = field(default_factory=dict)
    resumed: bool = False


def _refuse_resuming_nemo_gym_output(settings: Any) -> None:
    """``resume_from_cache=true`` with files at ``output_jsonl_fpath`` but no gym_ray run folder: NeMo Gym
    0.7's own output. gym_ray cannot count what 0.7 recorded as done, and a fresh run would collect every
    rollout again and replace those files: refused, before anything is written."""
    if settings.resume_from_cache is not True or settings.output_jsonl_fpath is None:
        return
    paths = nemo_gym_paths(settings.output_jsonl_fpath)
    found = [p for p in (paths.rollouts, paths.failures, paths.materialized_inputs) if p.exists()]
    if found:
        raise ResumeError(
            f"resume_from_cache is true, but {paths.rollouts.parent} holds output for "
            f"{settings.output_jsonl_fpath} ({', '.join(p.name for p in found)}) and no gym_ray run folder "
            f"({Path(str(settings.output_dir)) / RUN_MANIFEST} is missing): gym_ray cannot resume NeMo Gym's "
            "own output, and a run would collect every rollout again and replace those files; resume it "
            "with ng_collect_rollouts, or move the files aside (or pass another output_jsonl_fpath) for a "
            "gym_ray run"
        )


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def check_run_folder(run: RunConfig, rows: Iterable[Mapping[str, Any]] | None = None) -> FolderCheck:
    """Refuse a command that does not fit its run folder, before anything is locked, written or started.

    Args:
        run: The run's config as the edge resolved it (``output_dir`` set: the preflight checked it).
        rows: Rows passed instead of ``input_jsonl_fpath`` (a sequence is digested; an iterator is not
            read).

    Returns:
        The record to write once the folder is held, and the bytes the checks read.

    Raises:
        RunLockError: Another process holds the folder.
        ResumeError: The folder holds another run: other config identity, input, plan settings, or
            servers at other addresses without ``use_new_config``; or ``resume_from_cache`` is false.
    """
    settings = run.settings
    root = Path(str(settings.output_dir))
    refuse_if_held(root)
    manifest_bytes = _read_bytes(root / RUN_MANIFEST)
    record_bytes = _read_bytes(root / RUN_RECORD_FILE)
    identity = input_identity(settings, rows)
    check = FolderCheck(
        record=encode_record(build_record(run, identity)),
        expect={RUN_MANIFEST: manifest_bytes, RUN_RECORD_FILE: record_bytes},
        resumed=manifest_bytes is not None,
    )
    if manifest_bytes is None:
        _refuse_resuming_nemo_gym_output(settings)
        return check
    if settings.resume_from_cache is False:
        raise ResumeError(
            f"run folder {root} already holds a run and resume_from_cache is false; gym_ray never "
            "deletes results: pass +resume_from_cache=true to resume it, or move the folder (and the "
            "output files) aside for a fresh run"
        )
    manifest = read_run_manifest(root) or {}
    refused = other_config_error(root, manifest.get("config_identity"), run.topology.identity_digest())
    if refused is not None:
        raise refused
    record = _parse_record(record_bytes)
    if record is None:
        return check  # a folder from before run records: planning checks its shards
    where = f"run folder {root} (recorded in {RUN_RECORD_FILE})"
    changed_input = input_change(record, identity)
    if changed_input is not None:
        raise ResumeError(f"{where}: {changed_input}; resume with the same input, or pass a new output_dir")
    changed_settings = settings_changes(record, settings, secret_patterns(run.topology.raw))
    if changed_settings:
        raise ResumeError(
            f"{where} was planned with other settings ({'; '.join(changed_settings)}); resume with the "
            "settings it was planned with, or pass a new output_dir"
        )
    moved = topology_changes(record, run.topology)
    if moved and not settings.use_new_config:
        raise ResumeError(
            f"{where} ran against other servers than this config resolves to ({'; '.join(moved)}); pass "
            "--use-new-config (Python: use_new_config=True) to resume against the servers this config "
            "names, or pass the config of the recorded ones"
        )
    return check


def _parse_record(raw: bytes | None) -> dict[str, Any] | None:
    """A format-2 record from its bytes; None for none, an older format or an unreadable file."""
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("format_version") != 2:
        return None
    return body

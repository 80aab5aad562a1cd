"""``gym-ray aggregate RUN_DIR [CONFIG... key=value ...] [--use-new-config]``: merge, then metrics again.

Which servers it talks to: without a config, the ones the run recorded in its folder
(``gym_ray_run.json``, :mod:`gym_ray.record.run_record`), whatever a config file says now; with a config,
the servers it resolves to, and where those differ from the recorded ones (a second ``gym-ray serve``
moved them, or another deployment answers) the command says how and refuses (exit 2) unless
``--use-new-config`` is given. A folder from before run records (``format_version`` 1: the config's
paths) is resolved from those paths, as then.

Never on a moving run, never making the folder worse:

- a folder whose run lock another process holds (a live run) is refused at once, naming the holder as a
  second run is refused (:class:`~gym_ray.errors.RunLockError`, exit 2); the command then holds the lock
  itself while it merges and aggregates, so no run starts meanwhile. A refused command writes nothing;
- the new metrics are written beside the old file and replace ``rollouts_aggregate_metrics.json`` only
  when every server answered, and a stale ``rollouts_aggregate_metrics.errors.json`` is removed then;
  otherwise the previous file is left byte for byte and the failed entries go to the errors file, which
  ``gym-ray status`` reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gym_ray.errors import AggregationError, UsageError
from gym_ray.finalize.aggregate import AGGREGATE_ERRORS_FILE, AGGREGATE_FILE_NAME, AggregateEntry
from gym_ray.record.run_lock import RunLock, refuse_if_held
from gym_ray.record.run_record import (
    RUN_RECORD_FILE,
    read_record,
    recorded_run_config,
    topology_changes,
)

__all__ = ["aggregate_main"]


def _split_config_args(items: Sequence[str]) -> tuple[list[str], list[str]]:
    paths: list[str] = []
    overrides: list[str] = []
    for item in items:
        if "=" in item and not Path(item).exists():
            overrides.append(item)
        elif overrides:
            raise UsageError(
                f"config file {item!r} comes after the overrides {overrides}; list the YAML files first, "
                "then the key=value overrides"
            )
        else:
            paths.append(item)
    if not paths:
        raise UsageError("no config file given; pass the YAML config(s) the run used, then any overrides")
    return paths, overrides


def _topology(run_dir: Path, items: list[str], use_new_config: bool) -> tuple[Any, str, bool]:
    """The topology to aggregate against, which servers those are (a phrase for the output), and whether
    they are not the recorded ones (``--use-new-config`` told so)."""
    from gym_ray.config.run_config import resolve_run_config

    record = read_record(run_dir)
    recorded = record is not None and record.get("format_version") == 2
    if items:
        paths, overrides = _split_config_args(items)
        run = asyncio.run(resolve_run_config(paths, overrides=overrides))
        moved = topology_changes(record, run.topology) if record is not None and recorded else []
        if moved and not use_new_config:
            raise UsageError(
                f"the config given resolves to other servers than the run in {run_dir} recorded "
                f"({RUN_RECORD_FILE}): {'; '.join(moved)}; pass --use-new-config to aggregate against "
                f"them, or leave the config out to use the recorded servers"
            )
        return run.topology, "the servers the config given names", bool(moved)
    if record is None:
        raise UsageError(
            f"run folder {run_dir} does not record the config its run used ({RUN_RECORD_FILE}); pass it: "
            f"gym-ray aggregate {run_dir} CONFIG.yaml"
        )
    if recorded:
        recorded_topology = recorded_run_config(record, run_dir).topology
        return recorded_topology, f"the servers recorded in {RUN_RECORD_FILE}", False
    try:  # format 1: the config's paths and overrides
        paths, overrides = [str(p) for p in record["config"]], [str(o) for o in record["overrides"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(
            f"{run_dir / RUN_RECORD_FILE} cannot be read ({exc!r}); pass the config: "
            f"gym-ray aggregate {run_dir} CONFIG.yaml"
        ) from exc
    run = asyncio.run(resolve_run_config(paths, overrides=overrides))
    return run.topology, f"the servers the config paths recorded in {RUN_RECORD_FILE} name", False


async def _aggregate(run_dir: Path, topology: Any, output: Path) -> tuple[Path | None, list[AggregateEntry]]:
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.finalize.aggregate import aggregate_run

    async with ServerClient(topology) as client:
        path = await aggregate_run(run_dir, topology, client, raise_on_error=False, output_path=output)
    if path is None:
        return None, []
    raw = await asyncio.to_thread(path.read_text, encoding="utf-8")
    return path, [AggregateEntry.model_validate(item) for item in json.loads(raw)]


def aggregate_main(args: argparse.Namespace) -> int:
    """``gym-ray aggregate RUN_DIR [CONFIG... key=value ...] [--use-new-config]``.

    Merges the shards into ``rollouts.jsonl``, calls ``/aggregate_metrics`` on each environment server
    (the recorded ones, or a config's: see the module docstring) and prints the key metrics per server.

    Returns:
        0 on success.

    Raises:
        UsageError: No run folder; no config given or recorded; a config that resolves to other servers
            than recorded, without ``--use-new-config``.
        RunLockError: A run (or another aggregate) holds the folder; nothing is written.
        AggregationError: One or more servers failed (the previous metrics file is unchanged).
    """
    from gym_ray.store import is_store_url

    if is_store_url(args.run_dir):  # a store folder: aggregated in a local copy, the results pushed back
        from gym_ray.store.mirror import folder_copy

        with folder_copy(args.run_dir, push=True) as (local, _):
            return aggregate_main(argparse.Namespace(**{**vars(args), "run_dir": str(local)}))
    from gym_ray.finalize.merge import merge_shards

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run folder {run_dir} does not exist; pass the folder a run wrote")
    refuse_if_held(run_dir)  # a live run: refused before anything is read from a server or written
    items = list(getattr(args, "config", None) or [])
    topology, source, moved = _topology(run_dir, items, bool(getattr(args, "use_new_config", False)))
    with RunLock(run_dir, what="aggregate"):  # no run starts on the folder while it is aggregated
        merged = merge_shards(run_dir)
        print(
            f"merged {len(merged.shards)} shard(s): {merged.successes} success(es), {merged.failures} "
            f"failure line(s) -> {merged.successes_path.name}"
        )
        print(f"servers: {source}" + (" (not the recorded ones: --use-new-config)" if moved else ""))
        final = run_dir / AGGREGATE_FILE_NAME
        fresh = run_dir / f".{AGGREGATE_FILE_NAME}.new"
        path, entries = asyncio.run(_aggregate(run_dir, topology, fresh))
        if path is None:
            print(f"no successes in {run_dir}: nothing to aggregate, no metrics file written")
            return 0
        for entry in entries:
            print(f"\nKey metrics for {entry.label} ({entry.environment_server}):")
            if entry.aggregation_error is not None:
                print(f"  aggregation failed: {entry.aggregation_error}")
            else:
                print(json.dumps(entry.key_metrics, indent=2))
        errors = run_dir / AGGREGATE_ERRORS_FILE
        failed = [e.environment_server for e in entries if e.aggregation_error is not None]
        if failed:
            os.replace(fresh, errors)
            _fsync_dir(run_dir)
            # The merge is new, the metrics the previous ones: the files beside P follow both.
            kept_metrics = final if final.exists() else None
            _republish(run_dir, merged.successes_path, merged.failures_path, kept_metrics)
            kept = f"no {final.name} was written"
            if final.exists():
                kept = f"the previous {final.name} is unchanged"
            raise AggregationError(
                f"/aggregate_metrics failed for {', '.join(failed)}; {kept}; the failed entries are in "
                f"{errors}. Start {source} and rerun `gym-ray aggregate {run_dir}`, or pass the config of "
                "the running ones with --use-new-config",
                servers={
                    e.environment_server: str(e.aggregation_error) for e in entries if e.aggregation_error
                },
            )
        os.replace(fresh, final)
        errors.unlink(missing_ok=True)  # the last aggregate succeeded: an older failure's entries are stale
        _fsync_dir(run_dir)
        published = _republish(run_dir, merged.successes_path, merged.failures_path, final)
    print(f"\nwrote {final}")
    if published is not None:
        print(f"published under NeMo Gym's names: {published} and the files beside it")
    return 0


def _republish(run_dir: Path, rollouts: Path, failures: Path, metrics: Path | None) -> Path | None:
    """Publish the folder's files again under ``output_jsonl_fpath`` when its run used NeMo Gym's layout,
    so the files beside ``P`` are this aggregate's, not links to the files it replaced; ``P``, or None when
    the run recorded no ``output_jsonl_fpath`` or ``P``'s run folder (as resolved from here) is not this one.
    """
    from gym_ray.finalize.nemo_layout import publish_nemo_gym_layout

    record = read_record(run_dir)
    config = record.get("config") if record is not None else None
    if record is None or not isinstance(config, dict) or not config.get("output_jsonl_fpath"):
        return None
    settings = recorded_run_config(record, run_dir).settings
    target = Path(str(settings.output_dir))
    if settings.output_jsonl_fpath is None or not (target.is_dir() and os.path.samefile(target, run_dir)):
        return None
    paths = publish_nemo_gym_layout(
        run_dir, settings.output_jsonl_fpath, rollouts=rollouts, failures=failures, metrics=metrics
    )
    return paths.rollouts


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

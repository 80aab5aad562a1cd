"""Distributed collection against the reference servers: same output as one process, aggregate metrics
once per environment server, resume after a cancelled run, pull-based shards beat a static split."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray._private.state as ray_state

from gym_ray import keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.distributed.api import acollect, plan_from_config, run_actors
from gym_ray.errors import ConfigError, ValidationError
from gym_ray.finalize.metrics_summary import read_metrics_summary, written_summary
from gym_ray.plan.first_pass import validate_ahead
from gym_ray.record.ledger import check_run
from gym_ray.record.shard_files import list_shards, shard_paths
from gym_ray.run.collect import acollect_local
from gym_ray.servers import ThreadedDeployment, bundled_dataset_path, load_bundled_config, start_in_thread
from tests.distributed.module_notes import finalize_noting_counts, shard_dying_once

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

ENVS = ("arith_env", "arith_env_hard")
AGENTS = ("arith_agent", "arith_agent_hard")


def _config(latency_ms: dict[str, int]) -> dict[str, Any]:
    cfg = load_bundled_config()
    for env in ENVS:
        block = cfg[env]["environment_servers"]["example_env"]
        block["latency_ms"] = latency_ms[env]
        block["latency_jitter_ms"] = 0
    return cfg


def _rows(count: int, *, hard: range | None = None) -> list[dict[str, Any]]:
    """``count`` dataset rows; rows in ``hard`` go to the hard agent, others alternate agents."""
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    rows = []
    for index in range(count):
        row = json.loads(lines[index % len(lines)])
        row["row_number"] = index  # distinct rows: identical inputs would share a task index
        if hard is None:
            agent = AGENTS[index % 2]
        else:
            agent = AGENTS[1] if index in hard else AGENTS[0]
        row[keys.AGENT_REF] = {"name": agent}
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def servers() -> Iterator[ThreadedDeployment]:
    with start_in_thread(_config({"arith_env": 2, "arith_env_hard": 2})) as deployment:
        yield deployment


def _read_json(path: str) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


async def wait_for_completed(servers: ThreadedDeployment, envs: tuple[str, ...], count: int) -> None:
    """Wait until the servers completed ``count`` /run requests in total (at most 60 s)."""
    for _ in range(3000):
        if sum(servers.stats(env).completed for env in envs) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the servers did not complete {count} requests within 60 s")


def _outcomes(path: str) -> dict[tuple[int, int], Any]:
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        out[(record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])] = record.get(keys.REWARD)
    return out


async def test_four_workers_give_the_same_rollouts_as_one_process(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path
) -> None:
    rows = _rows(150)
    common = {"num_repeats": 2, "shard_size": 20, "max_resident_tasks": 32}
    local = await acollect_local(servers.config, rows=rows, output_dir=str(tmp_path / "local"), **common)
    servers.reset_stats()
    dist = await acollect(
        servers.config, rows=rows, output_dir=str(tmp_path / "dist"), num_workers=4, **common
    )
    # one shard file set per shard: 300 rollouts cut at 20 rows (tasks never split) -> 15 shards
    shards = list_shards(tmp_path / "dist")
    assert shards == [f"{i:05d}" for i in range(15)]
    for shard in shards:
        paths = shard_paths(tmp_path / "dist", shard)
        assert [paths.successes.exists(), paths.materialized_inputs.exists(), paths.manifest.exists()] == [
            True,
            True,
            True,
        ]
    assert (dist.planned, dist.succeeded + dist.failed, dist.num_workers) == (300, 300, 4)
    assert _outcomes(dist.rollouts_path) == _outcomes(local.rollouts_path)
    assert len(_outcomes(dist.rollouts_path)) == local.succeeded
    assert dist.key_metrics == local.key_metrics
    assert {env: servers.stats(env).aggregate_calls for env in ENVS} == {env: 1 for env in ENVS}
    report = check_run(dist.run_dir)
    assert (report.lost, report.missing, report.duplicates, report.unexpected) == (0, 0, 0, 0)
    summary = _read_json(dist.summary_path)
    assert summary["distributed"]["num_workers"] == 4
    assert summary["distributed"]["shards_reported"] == 15
    # the coordinator reduced finished shards while the run went on; the merge took them and removed them
    assert 1 <= summary["distributed"]["shards_reduced_ahead_of_the_merge"] <= 15
    # and grouped the merged prefix's rows for /aggregate_metrics, which the aggregate took over (the
    # metrics are the single process's, above)
    assert 1 <= summary["distributed"]["rows_grouped_ahead_of_the_aggregate"] <= dist.succeeded
    assert not (tmp_path / "dist" / ".merge-ahead").exists()
    # The caller holds the host's summary of the metrics file, so printing the headline reads no file.
    written = written_summary()
    assert written is not None
    stat = os.stat(str(dist.metrics_path))
    assert written[0] == (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    lists = ("group_level_metrics", "repeat_level_metrics")
    entries = [
        {k: v for k, v in entry.items() if k not in lists} for entry in _read_json(str(dist.metrics_path))
    ]
    assert json.loads(written[1]) == entries == read_metrics_summary(str(dist.metrics_path))


def _recorded(run_dir: Path) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for shard in list_shards(run_dir):
        paths = shard_paths(run_dir, shard)
        for path in (paths.successes, paths.failures):
            if not path.exists():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn tail: the writer repairs it on open
                found.add((record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX]))
    return found


def _exited(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting as we read
        return True
    return "\nState:\tZ" in status  # a zombie runs no code


async def _wait_for_exit(pids: list[int]) -> None:
    for _ in range(3000):
        if all(_exited(pid) for pid in pids):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"processes {pids} still run 60 s after their actors were killed")


async def test_a_cancelled_run_resumes_under_another_worker_count_without_redispatch(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path
) -> None:
    rows = _rows(120)
    settings = {"num_repeats": 2, "shard_size": 10, "max_resident_tasks": 4}
    servers.reset_stats()
    earlier_actors = set(ray_state.actors())
    first = asyncio.ensure_future(
        acollect(servers.config, rows=rows, output_dir=str(tmp_path), num_workers=3, **settings)
    )
    await wait_for_completed(servers, ENVS, 40)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    # ray.kill returns before the processes are gone: read the folder once nothing of the first run can
    # still write to it.
    await _wait_for_exit(
        [a["Pid"] for actor_id, a in ray_state.actors().items() if actor_id not in earlier_actors]
    )
    before = _recorded(tmp_path)
    assert 0 < len(before) < 240
    servers.reset_stats()
    result = await acollect(servers.config, rows=rows, output_dir=str(tmp_path), num_workers=2, **settings)
    requested_again = {
        identity for env in ENVS for identity in servers.stats(env).request_counts if identity in before
    }
    assert requested_again == set()
    assert (result.planned, result.succeeded + result.failed) == (240, 240)
    assert result.dispatched == 240 - len(before)
    report = check_run(tmp_path)
    assert (report.lost, report.missing, report.duplicates) == (0, 0, 0)


def _makespans(timings: list[dict[str, Any]], num_workers: int) -> tuple[float, float]:
    """(pull makespan as run, static contiguous split makespan), from the same shard timings."""
    per_worker: dict[str, float] = {}
    for timing in timings:
        per_worker[timing["worker"]] = per_worker.get(timing["worker"], 0.0) + timing["wall_s"]
    ordered = [t["wall_s"] for t in sorted(timings, key=lambda t: t["shard"])]
    block = -(-len(ordered) // num_workers)
    static = max(sum(ordered[i : i + block]) for i in range(0, len(ordered), block))
    return max(per_worker.values()), static


async def test_pull_based_shards_finish_before_a_static_split(ray_session: Any, tmp_path: Path) -> None:
    # The first quarter of the rows goes to a slow environment server: a static contiguous split would
    # give all of it to one worker; pulling spreads it.
    with start_in_thread(_config({"arith_env": 1, "arith_env_hard": 250})) as slow:
        rows = _rows(160, hard=range(40))
        cfg = await resolve_run_config(
            slow.config, settings={"output_dir": str(tmp_path), "shard_size": 10, "max_resident_tasks": 16}
        )
        rows_ref = ray_session.put(rows)
        result = await run_actors(
            cfg,
            functools.partial(plan_from_config, cfg, rows_ref),
            run_dir=str(tmp_path),
            num_workers=4,
            shards_in_flight=1,
        )
    timings = _read_json(result.summary_path)["distributed"]["shard_timings"]
    assert len(timings) == 16
    pull, static = _makespans(timings, 4)
    print(f"straggler: pull makespan {pull:.3f} s, static split makespan {static:.3f} s")
    assert pull < static


async def test_800_rollouts_on_2_workers_occupy_both_with_the_automatic_shard_size(
    servers: ThreadedDeployment, tmp_path: Path
) -> None:
    result = await acollect(
        servers.config, rows=_rows(200), num_workers=2, output_dir=str(tmp_path), num_repeats=4
    )
    assert (result.planned, result.succeeded) == (800, 800)
    manifest = _read_json(str(tmp_path / "run_manifest.json"))
    assert (manifest["shard_size"], manifest["num_shards"]) == (100, 8)  # 800 / (4 shards x 2 workers)
    timings = _read_json(result.summary_path)["distributed"]["shard_timings"]
    assert sorted({t["worker"] for t in timings}) == ["w0", "w1"]
    assert check_run(tmp_path).ok


async def test_a_bad_row_is_refused_before_ray_starts(
    servers: ThreadedDeployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_ray(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray was started for an input with a bad row")

    monkeypatch.setattr("gym_ray.distributed.api.ray_connection", no_ray)
    rows = _rows(6)
    rows[4][keys.AGENT_REF] = {"name": "arith_agnet"}
    expected = r"did you mean 'arith_agent'\?\) \[row 4 \(task 4, rollout 0\)\]"
    with pytest.raises(ValidationError, match=expected):
        await acollect(servers.config, rows=rows, num_workers=2, output_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("host", [None, "elsewhere"], ids=["taken", "another-host"])
async def test_the_driver_takes_over_the_callers_validation_pass(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path, host: str | None
) -> None:
    input_path = tmp_path / "rows.jsonl"
    input_path.write_text("".join(json.dumps(row) + "\n" for row in _rows(40)), encoding="utf-8")
    run_dir = tmp_path / "run"
    cfg = await resolve_run_config(
        servers.config,
        settings={"output_dir": str(run_dir), "input_jsonl_fpath": str(input_path), "num_repeats": 2},
    )
    checked = validate_ahead(cfg)
    if host is not None:
        checked = dataclasses.replace(checked, host=host)
    assert checked.folder is not None
    try:
        result = await run_actors(
            cfg,
            functools.partial(plan_from_config, cfg, None, 2, checked),
            run_dir=str(run_dir),
            num_workers=2,
        )
        # Nobody but the driver's dedupe removes a taken folder; one that was not taken is still there.
        left = await asyncio.to_thread(os.path.exists, checked.folder)
        assert left is (host is not None)
    finally:
        checked.discard()
    assert (result.planned, result.succeeded) == (80, 80)
    assert check_run(run_dir).ok


@pytest.mark.parametrize("worker_dies", [False, True], ids=["every-shard-once", "a-worker-lost"])
async def test_closing_counts_come_from_the_reports_only_when_every_shard_ran_once(
    ray_session: Any, servers: ThreadedDeployment, tmp_path: Path, worker_dies: bool
) -> None:
    rows = _rows(20)
    for row in rows[3], rows[11]:
        row["fault"] = "500"  # fails on every attempt: 2 failed rows to count
    run = await resolve_run_config(
        servers.config, settings={"output_dir": str(tmp_path / "run"), "shard_size": 5}
    )
    # The default shard function (None), or one whose first worker on shard 00001 exits its process.
    shard_fn = functools.partial(shard_dying_once, str(tmp_path / "died"), "00001") if worker_dies else None
    result = await run_actors(
        run,
        functools.partial(plan_from_config, run, ray_session.put(rows)),
        run_dir=str(tmp_path / "run"),
        num_workers=2,
        shard_fn=shard_fn,
        finalize_fn=functools.partial(finalize_noting_counts, str(tmp_path)),
    )
    # Counted from the workers' reports when no shard changed hands; read again after a lost worker.
    assert json.loads((tmp_path / "counts_from_reports.json").read_text()) is (not worker_dies)
    assert (tmp_path / "died").exists() is worker_dies
    assert (result.planned, result.succeeded, result.failed, result.pending) == (20, 18, 2, 0)
    assert (result.resumable, result.complete) == (2, False)
    assert check_run(tmp_path / "run").as_dict()["duplicates"] == 0


async def test_a_control_actors_resource_no_node_holds_is_refused_before_anything_runs(
    servers: ThreadedDeployment, ray_session: Any, tmp_path: Path
) -> None:
    servers.reset_stats()
    with pytest.raises(ConfigError) as caught:
        await acollect(
            servers.config,
            rows=_rows(4),
            output_dir=str(tmp_path / "run"),
            num_workers=1,
            control_actors_resource="gym_ray_nowhere",
            progress=False,
        )
    assert str(caught.value) == (
        "control_actors_resource='gym_ray_nowhere': no node of this Ray cluster holds that resource "
        "(custom resources: none); give a node of the cluster the run joins (--address / RAY_ADDRESS) that "
        "resource, `ray start --resources='{\"gym_ray_nowhere\": 1}'`, or leave the setting out to place "
        "the driver and the coordinator on this node"
    )
    assert sum(servers.stats(env).requests for env in ENVS) == 0
